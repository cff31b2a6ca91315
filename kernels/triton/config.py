"""Launch configs of the fused MoE GEMMs: tuned data files first, a heuristic otherwise.

Files live in `kernels/configs/` and are named
    E={E},N={I},device_name={torch device name, spaces -> _},dtype={dtype key}.json
(N is the per-expert intermediate size, as in vLLM). Each maps a token count M to
    {"BLOCK_M": .., "gemm1": {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"[, "SWAP_AB", "TMA",
     "MAXNREG", "HALF_MMA"]},
     "gemm2": {...}[, "CHAIN", "TAIL_M", "SORTED_INTER", "GEMM2_BLOCK_M"]}
and the entry with the nearest M is used (GEMV rows only up to one row per expert, 1/8 for MXFP4: `_entries_for`).
BLOCK_M is shared because it sets the alignment padding both GEMMs read (1: one slot per block,
multiplied on CUDA cores, for decode; GEMM2 may split its blocks, GEMM2_BLOCK_M); everything else is tuned per GEMM
(their K and N differ).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from moerules.quant import Granularity

from ..mx import MX_GROUP
from ..scheme import Scheme
from .align import use_naive_assignment

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    SWAP_AB: bool = False  # weights on the MMA's M side, tokens on its N side (fused_moe._dot)
    TMA: bool = False  # weight tiles copied by the TMA engine (sm_90+), not by address (fused_moe._tma_tile)
    # ptxas's cap on registers per thread (Triton's maxnreg), for a tile that a few registers more would leave one
    # program per SM fewer than its shared memory allows (a data file's choice, from a measurement).
    MAXNREG: Optional[int] = None
    # Under 128x128 block scaling, two MMAs per K step, one per half of the tile's weight rows (GEMM1: gate, up; GEMM2:
    # the two column halves), each promoted into its own accumulator (fused_moe._k_loop_halves): the fresh product is
    # half the tile, so 128-row tiles can take 256 weight rows without spilling.
    HALF_MMA: bool = False
    # Programs per SM of a persistent launch (0: one program per tile): each program runs tiles in turn, the K loops
    # of its tiles flattened into one pipelined loop (Triton's tl.range(flatten=True)), so a tile's first loads are in
    # flight during the previous tile's epilogue. Whole BLOCK_M tiles of the sorted assignment: no tail tiles, GEMV
    # rows, GEMM2_BLOCK_M or chained launches. On the H100 (bench/results/s49) GEMM2 reading a sorted intermediate by
    # TMA ran 1.12x faster so at Qwen3-30B-A3B bf16 M=16384 (6% more than sorted alone); A gathered by address, both
    # GEMMs lost at 17 of 18 points M >= 4096 (0.05-0.97x: the epilogue lives across the flattened loop).
    PERSISTENT: int = 0


@dataclass(frozen=True)
class MoEConfig:
    BLOCK_M: int
    gemm1: GemmConfig
    gemm2: GemmConfig
    # Both GEMMs and the top-k sum in one launch, GEMM2's tiles waiting on their slot's GEMM1 tiles (chain.py): for
    # decode batches under the naive assignment, where each launch's fixed cost is much of its time.
    CHAIN: bool = False
    # Rows of the tail tiles (0: none): an expert's remainder of at most TAIL_M rows past its whole BLOCK_M tiles
    # takes one swapped tile of TAIL_M rows in the same launch instead of a padded BLOCK_M one (align.py).
    TAIL_M: int = 0
    # GEMM1 stores the intermediate by aligned row (the r-th row of the sorted order at row r, padding rows zero), not
    # by slot, so GEMM2 reads each A tile as one box of rows, by TMA with gemm2.TMA (tail tiles by address), instead
    # of gathering its rows by slot: for batches that take the sorted assignment (not the naive one), unchained.
    SORTED_INTER: bool = False
    # GEMM2's rows per tile (0: BLOCK_M), a power of two below BLOCK_M and not below TAIL_M: GEMM2 then runs each
    # BLOCK_M tile as BLOCK_M / GEMM2_BLOCK_M tiles (a tail tile whole), those holding only padding exit at once. Both
    # GEMMs read one alignment, and their best row tiles can differ: at DeepSeek-V3 FP8 block-128 M=4096 on the H100,
    # GEMM1 on 128-row tiles with GEMM2 on 64-row ones ran 1.018x faster than both on 128. Halving the rows of a tile
    # tuned at 128 lost everywhere else, 0.62-0.96x, though up to a third of GEMM2's rows were padding there
    # (bench/results/s48 a.). For batches that take the sorted assignment, unchained.
    GEMM2_BLOCK_M: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        return cls(BLOCK_M=d["BLOCK_M"], gemm1=GemmConfig(**d["gemm1"]), gemm2=GemmConfig(**d["gemm2"]),
                   CHAIN=d.get("CHAIN", False), TAIL_M=d.get("TAIL_M", 0), SORTED_INTER=d.get("SORTED_INTER", False),
                   GEMM2_BLOCK_M=d.get("GEMM2_BLOCK_M", 0))

    @property
    def persistent(self) -> bool:
        """Whether either GEMM launches persistently (GemmConfig.PERSISTENT)."""
        return bool(self.gemm1.PERSISTENT or self.gemm2.PERSISTENT)

    @property
    def gemm2_block_m(self) -> int:
        """The rows of GEMM2's tiles."""
        return self.GEMM2_BLOCK_M or self.BLOCK_M

    def to_dict(self) -> dict:
        """As the data files hold it: a GEMM's MAXNREG only where it caps registers, its HALF_MMA, PERSISTENT, CHAIN,
        TAIL_M, SORTED_INTER and GEMM2_BLOCK_M only where set."""
        d = asdict(self)
        for gemm in ("gemm1", "gemm2"):
            if d[gemm]["MAXNREG"] is None:
                del d[gemm]["MAXNREG"]
            for optional in ("HALF_MMA", "PERSISTENT"):
                if not d[gemm][optional]:
                    del d[gemm][optional]
        for optional in ("CHAIN", "TAIL_M", "SORTED_INTER", "GEMM2_BLOCK_M"):
            if not d[optional]:
                del d[optional]
        return d


def dtype_key(scheme: Scheme, in_dtype_name: str) -> str:
    """Which config family a scheme uses: tiles depend on operand widths and block scaling."""
    if scheme.weight_dtype is None:
        return in_dtype_name
    if scheme.is_mx:
        return scheme.family.value  # "mxfp4_w4a16" / "mxfp8": their K steps are bound to the 32-groups
    if scheme.act_dtype is None:
        return "w8a16"
    base = f"{scheme.act_dtype.value.split('_')[0]}_w8a8"
    return base + ("_block128" if scheme.weight_granularity == Granularity.block128 else "")


def config_file_name(*, num_experts: int, intermediate: int, device_name: str, dtype: str) -> str:
    return f"E={num_experts},N={intermediate},device_name={device_name.replace(' ', '_')},dtype={dtype}.json"


def tuned_devices(*, num_experts: int, intermediate: int, dtype: str) -> list[str]:
    """The devices (as the file names spell them) with a tuned file for this shape and dtype key."""
    before, after = config_file_name(num_experts=num_experts, intermediate=intermediate, device_name="*",
                                     dtype=dtype).split("*")
    return sorted(path.name[len(before):-len(after)] for path in CONFIG_DIR.glob(f"{before}*{after}"))


@functools.lru_cache(maxsize=None)
def _load_file(name: str) -> Optional[dict[int, MoEConfig]]:
    path = CONFIG_DIR / name
    if not path.is_file():
        return None
    return {int(m): MoEConfig.from_dict(c) for m, c in json.loads(path.read_text()).items()}


def default_config(*, num_tokens: int, num_experts: int, top_k: int, scheme: Scheme) -> MoEConfig:
    """Heuristic for shapes without a tuned file.

    BLOCK_M follows the expected rows per expert (padding waste vs MMA efficiency); small
    blocks stream weights with narrow N tiles for more programs in flight; 8-bit operands
    take a longer K step for the same bytes per load (both K steps divide the 128 of block scales).
    MX has its own table (`_mx_config`).
    """
    rows_per_expert = num_tokens * top_k / num_experts
    if scheme.is_mx:
        return _mx_config(rows_per_expert, fp4=scheme.k_pack > 1)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 48 else 64 if rows_per_expert <= 160 else 128
    block_k = 128 if scheme.weight_dtype is not None else 64
    small = block_m <= 32
    g = GemmConfig(BLOCK_N=64 if small else 128, BLOCK_K=block_k, GROUP_M=1 if small else 8,
                   num_warps=4 if small else 8, num_stages=4 if small else 3)
    return MoEConfig(BLOCK_M=block_m, gemm1=g, gemm2=g)


# MX decode: GEMV rows, narrow N tiles, deep K steps on both GEMMs, as the tuner reached them on the H200 for both
# gpt-oss models at M=1 (MXFP4, group-major scales: 53.9 us against 57.6 for session 28's GEMM1 tile, 32 wide on
# 1 stage; bench/results/s29 c.; MXFP8: 70.4 and 67.7 us against 95 for the 16-row MMA tiles, s30). In checkpoint
# order, MXFP4's GEMV rows had beaten the best 16-row MMA tiles 1.44x (H100).
_MXFP4_GEMV = GemmConfig(BLOCK_N=16, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=2, SWAP_AB=True)
_MXFP8_GEMV = GemmConfig(BLOCK_N=16, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=2)
# The most rows per expert GEMV rows serve: each slot reads its expert's weights again, at 6.4-7.0 SASS per weight
# to the MMA tiles' 3.8 (MXFP4, bench/sass_count.py). H200 (s29 c., d.): at 1/32 and 1/8 row per expert (gpt-oss-120b
# and -20b at M=1) MXFP4's GEMV rows ran 53.9 us against 56.3-56.5 for the 16-row MMA tile; at 1/2 (gpt-oss-120b
# M=16) 484.4 against 289.2; MXFP8's at 1/2, 602.2 against 529.9 (s30).
_MX_GEMV_ROWS = 1 / 8
# MXFP4 MMA tiles: triton_kernels' Hopper shape at 4 warps (128 weight rows on wgmma's M side, 128-deep K steps),
# the fastest seed at all 12 gpt-oss points with M >= 16 on the H200 in fragment order (bench/results/s28 b.).
_MXFP4_GEMM1 = GemmConfig(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, SWAP_AB=True)
_MXFP4_GEMM2 = GemmConfig(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, SWAP_AB=True)
# MXFP8 MMA tiles, the H200 tuner's at both gpt-oss models (bench/results/s30): 4 warps, narrow GEMM1 tiles (each
# weight tile is dequantised in registers), 128-deep K steps at 16-row blocks, 64-deep from 32 rows.
_MXFP8_SMALL = (GemmConfig(BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
                GemmConfig(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3))
_MXFP8_LARGE = (GemmConfig(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3),
                GemmConfig(BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4))


def _mx_config(rows_per_expert: float, *, fp4: bool) -> MoEConfig:
    """MX defaults, from sweeps on gpt-oss shapes (H200, Triton 3.6; bench/moe.py --phase tune refines).

    Every BLOCK_M block of an expert dequantises that expert's weights again, so BLOCK_M is the smallest power of two
    that holds the mean rows per expert (one block, one decode): MXFP4 in checkpoint order at M=2048 ran one 64-row
    block 1.36x faster than a 128-row one and 2x faster than two 32-row ones, and the tuned tiles of both formats
    mostly keep that rule; up to _MX_GEMV_ROWS rows per expert, GEMV rows (BLOCK_M 1).
    """
    if rows_per_expert <= _MX_GEMV_ROWS:
        gemv = _MXFP4_GEMV if fp4 else _MXFP8_GEMV
        return MoEConfig(BLOCK_M=1, gemm1=gemv, gemm2=gemv)
    block_m = next(b for b in (16, 32, 64, 128) if rows_per_expert <= b or b == 128)
    if fp4:
        return MoEConfig(BLOCK_M=block_m, gemm1=_MXFP4_GEMM1, gemm2=_MXFP4_GEMM2)
    return MoEConfig(block_m, *(_MXFP8_SMALL if block_m == 16 else _MXFP8_LARGE))


def get_config(*, num_tokens: int, num_experts: int, intermediate: int, top_k: int, scheme: Scheme,
               in_dtype_name: str, device_name: str) -> MoEConfig:
    key = dtype_key(scheme, in_dtype_name)
    table = _load_file(config_file_name(num_experts=num_experts, intermediate=intermediate,
                                        device_name=device_name, dtype=key))
    entries = table and _entries_for(table, rows_per_expert=num_tokens * top_k / num_experts,
                                     gemv_rows=_MX_GEMV_ROWS if scheme.is_mx else 1,
                                     naive=use_naive_assignment(num_tokens * top_k, num_experts))
    if entries:
        cfg = entries[min(entries, key=lambda m: abs(m - num_tokens))]
    else:
        cfg = default_config(num_tokens=num_tokens, num_experts=num_experts, top_k=top_k, scheme=scheme)
    check_config(cfg, scheme)
    return cfg


def _entries_for(table: dict[int, MoEConfig], *, rows_per_expert: float, gemv_rows: float,
                 naive: bool) -> dict[int, MoEConfig]:
    """The tuned entries that may serve a batch with this mean rows per expert: all, except GEMV rows (BLOCK_M 1)
    past gemv_rows rows per expert, where each row would read its expert's weights again (the tuner seeds them only
    up to one row, `bench/moe.py`; MX GEMV rows lose sooner, `_MX_GEMV_ROWS`), and chained entries (CHAIN) unless
    the batch takes the naive assignment (`naive`), the only one they run, and sorted intermediates (SORTED_INTER),
    GEMM2 row tiles (GEMM2_BLOCK_M) and persistent GEMMs (PERSISTENT) only if it does not (the naive assignment has
    no sorted order, one slot per block). Nearest M alone sent Mixtral-8x7B at M=16 (4 rows per expert) on the H200
    to the M=1 entry's GEMV rows: 2321 us against 644 us for vLLM 0.33 (bench/results/s27)."""
    return {m: cfg for m, cfg in table.items()
            if (cfg.BLOCK_M > 1 or rows_per_expert <= gemv_rows) and (naive or not cfg.CHAIN)
            and not (naive and (cfg.SORTED_INTER or cfg.GEMM2_BLOCK_M or cfg.persistent))}


def batched_config(*, num_tokens: int, num_experts: int, top_k: int, max_tokens: int, scheme: Scheme) -> MoEConfig:
    """Heuristic config of the batched experts (no tuned files yet).

    The standard heuristic at the expected rows per local expert, num_tokens * top_k / num_experts
    with this rank's tokens and experts (under expert parallelism each local expert gathers from every
    rank, which cancels the smaller E_local), with BLOCK_M no larger than a batch of max_tokens rows needs.
    """
    cfg = default_config(num_tokens=num_tokens, num_experts=num_experts, top_k=top_k, scheme=scheme)
    cfg = replace(cfg, BLOCK_M=min(cfg.BLOCK_M, max(16, 1 << (max_tokens - 1).bit_length())))
    check_batched_config(cfg, scheme)
    return cfg


def check_batched_config(cfg: MoEConfig, scheme: Scheme) -> None:
    """`check_config`, plus: GEMM1 folds a group amax per tile, so its tiles must not straddle a 1x128 group;
    the batched kernels are tested with MMA tiles only (no GEMV rows), one row tile for both GEMMs."""
    check_config(cfg, scheme)
    if cfg.BLOCK_M < 16:
        raise ValueError(f"BLOCK_M={cfg.BLOCK_M}: the batched kernels take BLOCK_M >= 16")
    if cfg.GEMM2_BLOCK_M:
        raise ValueError("GEMM2_BLOCK_M: the batched kernels run both GEMMs on BLOCK_M rows; remove GEMM2_BLOCK_M")
    if scheme.act_granularity == Granularity.group128 and 128 % cfg.gemm1.BLOCK_N:
        raise ValueError(f"gemm1: BLOCK_N={cfg.gemm1.BLOCK_N} must divide 128 for group-quantised intermediates")


MAXNREG_RANGE = (24, 255)  # below 24 ptxas cannot place a kernel's fixed registers; sm_90 allows 255


def check_config(cfg: MoEConfig, scheme: Scheme) -> None:
    """Reject configs the kernels cannot run correctly (a bad data file must fail loudly)."""
    for name, g in (("gemm1", cfg.gemm1), ("gemm2", cfg.gemm2)):
        if scheme.weight_granularity == Granularity.block128 and 128 % g.BLOCK_K:
            raise ValueError(f"{name}: BLOCK_K={g.BLOCK_K} must divide 128 for block-scaled weights")
        if scheme.is_mx and g.BLOCK_K % MX_GROUP:
            raise ValueError(f"{name}: BLOCK_K={g.BLOCK_K} must be a multiple of {MX_GROUP} for MX weights (whole "
                             "e8m0 groups per K step)")
        low, high = MAXNREG_RANGE
        if g.MAXNREG is not None and not low <= g.MAXNREG <= high:
            raise ValueError(f"{name}: MAXNREG={g.MAXNREG} must be a register count from {low} to {high} (ptxas's "
                             "per-thread cap), or absent")
        if g.TMA and cfg.BLOCK_M == 1:
            raise ValueError(f"{name}: TMA weight copies serve MMA tiles, not GEMV rows (BLOCK_M 1)")
        if g.HALF_MMA:
            _check_half_mma(name, g, cfg, scheme)
        if g.PERSISTENT:
            _check_persistent(name, g, cfg)
    if cfg.BLOCK_M != 1 and cfg.BLOCK_M < 16:
        raise ValueError(f"BLOCK_M={cfg.BLOCK_M} is below the smallest tl.dot tile (16); 1 selects the GEMV path")
    if cfg.TAIL_M and not (16 <= cfg.TAIL_M < cfg.BLOCK_M and cfg.TAIL_M & (cfg.TAIL_M - 1) == 0):
        raise ValueError(f"TAIL_M={cfg.TAIL_M} must be a power of two from 16 (the smallest tl.dot tile) below "
                         f"BLOCK_M={cfg.BLOCK_M}, or 0 for no tail tiles")
    if cfg.CHAIN:
        _check_chain(cfg, scheme)
    if cfg.SORTED_INTER:
        _check_sorted_intermediate(cfg, scheme)
    if cfg.GEMM2_BLOCK_M:
        _check_gemm2_rows(cfg)


def _check_half_mma(name: str, g: GemmConfig, cfg: MoEConfig, scheme: Scheme) -> None:
    """What HALF_MMA (GemmConfig) needs: 128x128 block-scaled weights, MMA tiles, and halves of at most one block of
    128 rows and at least tl.dot's 16 (GEMM1's halves, gate and up, are BLOCK_N rows each; the launch checks that
    they lie in one block each)."""
    if scheme.weight_granularity != Granularity.block128:
        raise ValueError(f"{name}: HALF_MMA promotes block-scaled products, and {scheme.cell} has no 128x128 weight "
                         "blocks; remove HALF_MMA from this config")
    half = g.BLOCK_N if name == "gemm1" else g.BLOCK_N // 2
    if cfg.BLOCK_M == 1 or cfg.CHAIN or not 16 <= half <= 128:
        raise ValueError(f"{name}: HALF_MMA takes MMA tiles (BLOCK_M >= 16, not chained) whose halves hold 16 to 128 "
                         f"weight rows (here {half}: BLOCK_N={g.BLOCK_N}); remove HALF_MMA or change BLOCK_N")


PERSISTENT_RANGE = (1, 4)  # programs per SM; the tuned tiles fit at most three on an H100 SM (bench/results/s47)


def _check_persistent(name: str, g: GemmConfig, cfg: MoEConfig) -> None:
    """What a persistent GEMM (GemmConfig.PERSISTENT) needs: whole BLOCK_M tiles of the sorted assignment, one tile
    shape, so that its tiles' K loops are one loop nest (fused_moe: the flattened tl.range)."""
    low, high = PERSISTENT_RANGE
    if not low <= g.PERSISTENT <= high:
        raise ValueError(f"{name}: PERSISTENT={g.PERSISTENT} must be the programs per SM, from {low} to {high}, or 0 "
                         "for one program per tile")
    if cfg.BLOCK_M == 1 or cfg.CHAIN or cfg.TAIL_M or (name == "gemm2" and cfg.GEMM2_BLOCK_M):
        raise ValueError(f"{name}: PERSISTENT runs whole BLOCK_M tiles of the sorted assignment, one tile shape, so "
                         "not with GEMV rows (BLOCK_M 1), CHAIN, TAIL_M or GEMM2_BLOCK_M; remove PERSISTENT or "
                         "those fields")


def _check_gemm2_rows(cfg: MoEConfig) -> None:
    """What GEMM2's own row tiles (MoEConfig.GEMM2_BLOCK_M) need: whole tl.dot tiles that split the BLOCK_M tiles of
    the sorted assignment evenly, each part whole blocks of the tail tiles' rows (the alignment's unit, align.py)."""
    g = cfg.GEMM2_BLOCK_M
    if not (16 <= g < cfg.BLOCK_M and g & (g - 1) == 0):
        raise ValueError(f"GEMM2_BLOCK_M={g} must be a power of two from 16 (the smallest tl.dot tile) below "
                         f"BLOCK_M={cfg.BLOCK_M}, or 0 for GEMM2 tiles of BLOCK_M rows")
    if cfg.TAIL_M > g:
        raise ValueError(f"GEMM2_BLOCK_M={g}: GEMM2's tiles are whole blocks of the alignment, TAIL_M={cfg.TAIL_M} "
                         "rows each; make GEMM2_BLOCK_M at least TAIL_M")
    if cfg.CHAIN:
        raise ValueError("GEMM2_BLOCK_M splits the BLOCK_M blocks of the sorted assignment, which chained launches do "
                         "not use; remove GEMM2_BLOCK_M or CHAIN")


def _check_chain(cfg: MoEConfig, scheme: Scheme) -> None:
    """What a chained config (chain.py) needs: one launch has one warp count and register cap, its tiles take
    address loads, and GEMM2 reads the intermediate as GEMM1 wrote it."""
    if scheme.quantizes_activations:
        raise ValueError(f"CHAIN: GEMM2 must read the intermediate unquantised, and {scheme.cell} quantises it; "
                         "remove CHAIN from this config")
    g1, g2 = cfg.gemm1, cfg.gemm2
    if (g1.num_warps, g1.MAXNREG) != (g2.num_warps, g2.MAXNREG):
        raise ValueError(f"CHAIN: one launch runs both GEMMs, so gemm1 and gemm2 need the same num_warps and MAXNREG "
                         f"(here {g1.num_warps}/{g1.MAXNREG} and {g2.num_warps}/{g2.MAXNREG})")
    if g1.TMA or g2.TMA:
        raise ValueError("CHAIN: the chained tiles load their weights by address; set \"TMA\": false in both GEMMs")
    if cfg.TAIL_M:
        raise ValueError("CHAIN: chained launches take the naive assignment, one slot per block, so no tail tiles; "
                         "remove TAIL_M from this config")


def _check_sorted_intermediate(cfg: MoEConfig, scheme: Scheme) -> None:
    """What a sorted intermediate (MoEConfig.SORTED_INTER) needs: the blocks of the sorted assignment, and an
    intermediate whose scales do not follow its rows (they would be indexed by slot)."""
    if cfg.BLOCK_M == 1 or cfg.CHAIN:
        raise ValueError("SORTED_INTER: the intermediate is laid out by the blocks of the sorted assignment, which "
                         "GEMV rows (BLOCK_M 1) and chained launches do not use; remove SORTED_INTER from this config")
    if scheme.is_mx or (scheme.quantizes_activations and scheme.act_granularity != Granularity.tensor):
        raise ValueError(f"SORTED_INTER: {scheme.cell} gives the intermediate scales per row or group, which GEMM2 "
                         "reads by slot; only unquantised and per-tensor intermediates can be sorted, so remove "
                         "SORTED_INTER from this config")
