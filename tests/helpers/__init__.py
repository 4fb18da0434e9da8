"""The test suite's shared library, imported as ``from helpers import ...`` (pyproject's pytest
``pythonpath`` puts tests/ on the import path; conftest.py holds only fixtures and hooks).

  data        seeds, dtypes, random arrays, scrambled paged pools
  layouts     a user array of any layout and rank as (B, H, S, D) and back
  isa         the instruction sets this CPU can run, and the default one
  bf16        bf16 products (bf16 inputs, float32 ones opted in) held to the flash rule
  tolerance   the same-precision twin that sets how far a kernel may sit from the reference
  checks      dense and paged calls held to attnx.reference
  delta       the gated delta rule's check and tolerance
  cache       a client's conversation with a shared PagedKVCache
  processes   code run in a fresh interpreter
  fuzz        the atheris harness (fuzz/) as a module
"""

from helpers.bf16 import (
    EMUL_MAX_RATIO,
    EMUL_MEAN_RATIO,
    PREFILL_SHAPES,
    TORCH_RATIO,
    all_prefill,
    assert_flash_rule,
    assert_p_rounding_bound,
    bf16_twin,
    errors,
    on_isa,
    prefill_problems,
    prefill_qkv,
    rounded_bf16,
)
from helpers.cache import bits, cache_state, cache_stepper, finish_client
from helpers.checks import check_attention, check_dense, check_paged, dense_views, native, same_bits
from helpers.data import (
    BF16,
    F32_EPS,
    RISES,
    SEED,
    climbing_scores,
    make_rng,
    pool_from_sequences,
    rand,
    scramble_tables,
)
from helpers.delta import (
    DELTA_ERR_FACTOR,
    DELTA_ULPS,
    DELTA_ULPS_STATE,
    assert_delta_matches,
    check_delta_rule,
    delta_expected,
    delta_tolerance,
)
from helpers.isa import (
    AMX_PATHS,
    BF16_DOT_GAIN,
    BF16_ISAS,
    BF16_PRODUCT_ISAS,
    INTEGER_PRODUCT_ISAS,
    ISAS,
    PATHS,
    WIDENING_TWIN,
    assert_set_isa_refused,
    best_isa,
    bf16_product_skip,
    cpus_here,
    has_amx,
    has_avx512,
    has_avx512bf16,
    has_bf16_products,
    has_neon_bf16,
    runs_here,
    supported_isas,
    threads_here,
    widening_path,
)
from helpers.layouts import from4, lse4, to4
from helpers.processes import run_isolated, script_words
from helpers.tolerance import (
    assert_matches,
    attention_tolerance,
    bf16_rounds_p,
    conditioning,
    lowp_attention,
)

__all__ = [
    "AMX_PATHS",
    "BF16",
    "BF16_DOT_GAIN",
    "BF16_ISAS",
    "BF16_PRODUCT_ISAS",
    "DELTA_ERR_FACTOR",
    "DELTA_ULPS",
    "DELTA_ULPS_STATE",
    "EMUL_MAX_RATIO",
    "EMUL_MEAN_RATIO",
    "F32_EPS",
    "INTEGER_PRODUCT_ISAS",
    "ISAS",
    "PATHS",
    "PREFILL_SHAPES",
    "RISES",
    "SEED",
    "TORCH_RATIO",
    "WIDENING_TWIN",
    "all_prefill",
    "assert_delta_matches",
    "assert_flash_rule",
    "assert_matches",
    "assert_p_rounding_bound",
    "assert_set_isa_refused",
    "attention_tolerance",
    "best_isa",
    "bf16_product_skip",
    "bf16_rounds_p",
    "bf16_twin",
    "bits",
    "cache_state",
    "cache_stepper",
    "check_attention",
    "check_delta_rule",
    "check_dense",
    "check_paged",
    "climbing_scores",
    "conditioning",
    "cpus_here",
    "delta_expected",
    "delta_tolerance",
    "dense_views",
    "errors",
    "finish_client",
    "from4",
    "has_amx",
    "has_avx512",
    "has_avx512bf16",
    "has_bf16_products",
    "has_neon_bf16",
    "lowp_attention",
    "lse4",
    "make_rng",
    "native",
    "on_isa",
    "pool_from_sequences",
    "prefill_problems",
    "prefill_qkv",
    "rand",
    "rounded_bf16",
    "run_isolated",
    "runs_here",
    "same_bits",
    "scramble_tables",
    "script_words",
    "supported_isas",
    "threads_here",
    "to4",
    "widening_path",
]
