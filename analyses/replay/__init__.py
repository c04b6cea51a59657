"""The replay: a recorded training step rebuilt as a graph and run again on a model of the links, so that a
policy's step time is the same graph with its collectives changed (dPRO, Daydream: papers.md, anchors.md).

- graph: the graph of each recorded step (its calls and the ranks' programs), built from the trace;
- links: the model of the links the flows cross (token buckets, max-min fair sharing);
- change: a policy as a change of the graph;
- simulation: the discrete-event replay of the ranks' programs on the links;
- fit: the links fitted from the same run;
- prediction: the run's replay, its check against the measured steps and a policy's predicted step.

    from analyses.replay.prediction import replay
    rp = replay(ctx)                  # the recorded steps as graphs, and the fitted links
    rp.check()                        # the unchanged replay against the measured steps: p50, p90
    rp.predict(Change(scale={"output_fwd": 0.5}))   # Prediction(step_s, low_s, high_s, ratio)
"""
