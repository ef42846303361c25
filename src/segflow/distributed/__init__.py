"""Data-parallel training over ``torch.distributed`` (gloo on CPU, NCCL on GPU)."""

from segflow.distributed.buckets import Bucket, GradientGroup, plan_buckets
from segflow.distributed.data_parallel import (
    DEFAULT_BUCKET_BYTES,
    DataParallel,
    DataParallelOptions,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "DataParallel", "DataParallelOptions",
           "GradientGroup", "plan_buckets"]
