"""Pieces of a training job: throughput and MFU, per-step figures to stdout, TensorBoard and a
JSON-lines log, and the loss plot. examples/train_llama.py puts them together (docs/training.md)."""
from torchpp.training.checkpointing import CheckpointLoop
from torchpp.training.flops import measure_matmul_tflops, training_flops_per_token
from torchpp.training.log import MetricsLog, plot_losses
from torchpp.training.metrics import StepTimer, peak_memory_bytes, pipeline_bubble

__all__ = ["CheckpointLoop", "MetricsLog", "StepTimer", "measure_matmul_tflops", "peak_memory_bytes", "pipeline_bubble",
           "plot_losses", "training_flops_per_token"]
