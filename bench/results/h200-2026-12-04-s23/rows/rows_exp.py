"""Session 23 experiment: the gemv form and the batch-1/2 decode fusions at more rows (with PDL)."""
import sys

R = int(sys.argv[1])
from flexspec_kernels import skinny_attention, skinny_linear, skinny_merge  # noqa: E402
from flexspec.models import llama  # noqa: E402

skinny_linear.GEMV_MAX_ROWS = R
skinny_attention.MAX_ROWS = skinny_merge.MAX_ROWS = llama.SKINNY_ATTENTION_ROWS = R
from bench.plain_overhead import main  # noqa: E402

main(sys.argv[2:])
