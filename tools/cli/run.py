"""`moerules run`: decide, build with seeded random weights (adapters too under features.lora), one checked forward."""

from __future__ import annotations

from typing import Callable, Optional

from moerules.kernels.builder import BIASED_ROUTING, build, default_device
from moerules.decision import Decision
from moerules.errors import RequestError
from moerules.limits import DEFAULT_CPU_RUN_GIB, MAX_RUN_TOKENS

# Rank of the random adapters a `features.lora` example runs with.
EXAMPLE_LORA_RANK = 8


RUN_STAGES = 3  # the calls of `stage` below: a progress line counts them


def run_example(decision: Decision, *, num_tokens: int = 16, seed: int = 0, device: Optional[str] = None,
                max_gib: Optional[float] = None, stage: Callable[[str], None] = lambda name: None) -> dict:
    """Build the decision's layer on seeded random weights and run one forward pass against the reference.

    `stage` is told each step as it starts (for a progress line). Raises RequestError, before allocating
    anything, for a device that is not here or a layer whose weights exceed `max_gib` (default:
    DEFAULT_CPU_RUN_GIB on a CPU, the free memory of a GPU).
    """
    stage("importing torch and the kernels")
    from moerules.kernels import make_random_lora, make_random_weights
    from moerules.kernels.example import run_forward
    config = decision.config
    device = check_device(default_device(device))
    check_size(decision, num_tokens=num_tokens, device=device, max_gib=max_gib)
    stage("generating seeded weights")
    weights = make_random_weights(num_experts=config.model.num_experts, hidden=config.model.hidden_size,
                                  intermediate=config.intermediate_per_partition, quant=config.quant,
                                  in_dtype=config.model.in_dtype, has_bias=config.model.has_bias, seed=seed,
                                  device=device, gated=config.model.activation.gated,
                                  correction_bias=config.model.routing in BIASED_ROUTING)
    if config.features.lora:
        weights.lora = make_random_lora(num_experts=config.model.num_experts, hidden=config.model.hidden_size,
                                        intermediate=config.intermediate_per_partition, rank=EXAMPLE_LORA_RANK,
                                        in_dtype=config.model.in_dtype, gated=config.model.activation.gated,
                                        seed=seed + 1, device=device)
    stage("building the layer and running the forward pass")
    layer = build(decision, weights, device=device)
    return run_forward(layer, num_tokens=num_tokens, seed=seed, device=device, top_k=config.model.top_k)


def check_device(name: str):
    """The torch.device `name` names, if this machine has it; RequestError otherwise."""
    import torch
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise RequestError(f"--device {name!r} is not a device name: use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise RequestError(f"--device {name!r}: moerules runs layers on cpu or cuda, not {device.type}")
    if not torch.cuda.is_available():
        raise RequestError(f"--device {name!r}: no CUDA device is available here (torch.cuda.is_available() is "
                           "False); use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise RequestError(f"--device {name!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def weight_bytes(decision: Decision) -> int:
    """Bytes `run` allocates for the layer's weights: the in_dtype master copy plus its quantised copy."""
    import torch

    from moerules.kernels.scheme import TORCH_DTYPE, Scheme
    config = decision.config
    model = config.model
    rows13 = 2 if model.activation.gated else 1
    elements = model.num_experts * (rows13 + 1) * model.hidden_size * config.intermediate_per_partition
    per_element = TORCH_DTYPE[model.in_dtype].itemsize
    scheme = Scheme.from_quant(config.quant)
    if scheme.weight_dtype is not None:
        per_element += torch.empty(0, dtype=scheme.weight_torch_dtype).element_size() / scheme.k_pack
    return int(elements * per_element)


def check_size(decision: Decision, *, num_tokens: int, device, max_gib: Optional[float]) -> None:
    """RequestError unless the tokens fit one forward and the layer's weights fit `max_gib` and the device."""
    if not 1 <= num_tokens <= MAX_RUN_TOKENS:
        raise RequestError(f"--tokens {num_tokens}: one forward takes 1 to {MAX_RUN_TOKENS:,} tokens")
    needed = weight_bytes(decision) / 2 ** 30
    if max_gib is None and device.type == "cpu":
        max_gib = DEFAULT_CPU_RUN_GIB
    if max_gib is not None and needed > max_gib:
        raise RequestError(f"this layer's random weights need {needed:.1f} GiB, over the --max-gib bound of "
                           f"{max_gib:g} GiB (default {DEFAULT_CPU_RUN_GIB:g} on a CPU); run a smaller config, or "
                           "raise --max-gib where the memory and the time are there")
    available = _available_gib(device)
    if needed > available:
        raise RequestError(f"this layer's random weights need {needed:.1f} GiB but {device} has {available:.1f} GiB "
                           "available; run a smaller config")


def _available_gib(device) -> float:
    if device.type == "cuda":
        import torch
        return torch.cuda.mem_get_info(device)[0] / 2 ** 30
    try:  # Linux: MemAvailable counts the page cache the kernel would give back
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2 ** 20
    except (OSError, ValueError):
        pass
    return float("inf")  # elsewhere there is nothing cheap to compare with
