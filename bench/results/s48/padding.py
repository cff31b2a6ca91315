# Rows GEMM2 computes per real row (slots) at the M >= 1024 points under the H100 files, as the aligned
# blocks pad them, and with GEMM2 on 64- or 32-row tiles (MoEConfig.GEMM2_BLOCK_M; parts holding padding alone exit).
# Routing as bench/moe.py draws it (fused_topk of normal logits). python bench/results/s48/padding.py > padding.txt
import json, torch
from moerules.kernels.routing import fused_topk
MODELS = {"mixtral-8x7b": (8, 2, 14336), "qwen3-30b-a3b": (128, 8, 768), "deepseek-v3": (256, 8, 2048), "gpt-oss-120b": (128, 4, 2880)}
FILES = {"bf16": "bf16", "fp8_tensor": "fp8_w8a8", "fp8_block": "fp8_w8a8_block128"}
for name, (E, k, I) in MODELS.items():
    for scheme, key in FILES.items():
        try:
            table = json.load(open(f"kernels/configs/E={E},N={I},device_name=NVIDIA_H100_80GB_HBM3,dtype={key}.json"))
        except FileNotFoundError:
            continue
        for M in (1024, 4096, 16384):
            cfg = table[min(table, key=lambda m: abs(int(m) - M))]
            gen = torch.Generator().manual_seed(1)
            torch.randn(M, 16, generator=gen)  # (x is drawn first in Bench.inputs; its size differs, so only approximate)
            ids, _ = fused_topk(torch.randn(M, E), top_k=k, renormalize=True)
            counts = torch.bincount(ids.flatten(), minlength=E).tolist()
            bm, tm = cfg["BLOCK_M"], cfg.get("TAIL_M", 0)
            def rows(g):
                total = 0
                for c in counts:
                    full, rest = divmod(c, bm)
                    total += full * bm
                    if rest == 0: continue
                    if tm and rest <= tm: total += tm; continue
                    total += -(-rest // g) * g if g else bm   # parts past the rest hold padding alone and exit
                return total
            real = M * k
            base = rows(0)
            s = "  ".join(f"g{g}: {rows(g)/real:.3f}" for g in (64, 32) if g < bm and g >= tm)
            print(f"{name:14} {scheme:10} M={M:5}  BLOCK_M {bm:3} TAIL {tm:2}  rows/real {base/real:.3f}  {s}")
