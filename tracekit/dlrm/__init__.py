"""The reference DLRM trainer: hybrid data/model parallelism, traced like any user script."""
