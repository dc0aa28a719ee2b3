"""`tessera quantize`: FP8/BF16 checkpoints -> INT4 W4A16 compressed-tensors checkpoints."""
