"""ckpt-core: move model weights from RL training workers to inference workers."""
