"""The size limits on everything moerules reads: rule files, config files, conditions, arch names.

Each limit is far above what a real rule set or config needs and far below what would exhaust
the stack, the memory or the numbers the rule engines can carry. Input over a limit is refused
with a typed error naming the limit; it is never truncated or partly read.
"""

# A rule or config file larger than this is not hand-written; reading it would only cost memory.
MAX_FILE_BYTES = 4 * 1024 * 1024

# YAML nesting (mappings and lists inside each other). Real files nest about 5 deep; converting
# and validating recurse once per level, and Python's stack holds about 1000 frames.
MAX_YAML_DEPTH = 64

# YAML nodes of one file after aliases are expanded (each use of an alias counts its whole anchor).
# The largest default rule file has ~400; the limit stops a few lines of nested aliases
# ("billion laughs") from expanding into billions of objects.
MAX_YAML_NODES = 100_000

# Digits of a number, in YAML or in a condition. Durable-rules carries numbers as 64-bit values,
# so a number of more than 18 digits would silently change meaning; inf and nan are no numbers
# a rule can compare, and Python's int() refuses 4,300 digits with a bare ValueError.
MAX_INT_DIGITS = 18

# `not` and parenthesis nesting in a condition. Real conditions nest 2-3 deep; the parser
# recurses once per level.
MAX_EXPR_DEPTH = 32

# A platform arch name: ASCII letters, digits and '_' only, e.g. sm_120, gfx1200, xe_hpc, aarch64.
MAX_ARCH_LENGTH = 32

# Digits of a CUDA compute capability after `sm_` (sm_90, sm_120); it becomes an int the rules compare.
MAX_CUDA_CC_DIGITS = 4

# Sizes and parallel degrees in a config. The largest MoE layers are ~16k wide with ~1k experts;
# a bound keeps every config field a number both rule engines carry exactly (64-bit in durable).
MAX_LAYER_DIM = 1 << 20
MAX_RANKS = 1 << 16

# A golden table moerules writes (a matrix/decisions/ file is ~1 MB); a larger file is not one of ours.
MAX_TABLE_BYTES = 256 * 1024 * 1024

# `moerules run`: tokens of its one forward pass, and its seed (torch generators take 64-bit seeds).
MAX_RUN_TOKENS = 1 << 16
MAX_SEED = (1 << 63) - 1

# GiB of weights `moerules run` generates on a CPU unless --max-gib says otherwise: random weights are
# drawn at roughly 0.1-0.3 GB/s on a CPU core, so a DeepSeek-V3 layer (~33 GiB with its bf16 master copy)
# would take minutes; on a GPU the bound is the device's free memory.
DEFAULT_CPU_RUN_GIB = 8.0
