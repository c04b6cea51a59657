"""tracekit: trace-driven profiling and analysis of distributed recommendation-model training."""

__version__ = "0.1.0"
