"""The invariants of reference/vllm-moe-oracle.md section 8 that apply to our rules, as
hypothesis properties over whole configs. CI runs the `ci` profile; `--hypothesis-profile=deep`
runs >= 100k examples per property."""

from __future__ import annotations

import random
import string

import pytest
from hypothesis import assume, given, strategies as st

from moerules.config import All2AllBackend, ModelShape
from moerules.decision import ActivationFormat, Outcome, QuantizedBy, ReasonCode, SelectedBy
from moerules.errors import UnknownBackendError
from moerules.engine.decide import Engine, _round_up
from moerules.engine.ruleset import RuleSet
from moerules.testing import configs, near_boundary

from invariants import BACKENDS, DURABLE, REFERENCE, RULES, decide, declared, priority_order, violated_constraints

any_config = configs(pins=BACKENDS)
auto_config = configs()


def forcing(strategy, section: str, **values):
    """The strategy with some fields fixed, so a property about them needs no filtering."""
    return strategy.map(lambda c: c.model_copy(update={section: getattr(c, section).model_copy(update=values)}))
A2A_DISPATCHER = {All2AllBackend.allgather_reducescatter: "allgather_reducescatter",
                  All2AllBackend.torch_all2all: "torch_all2all", All2AllBackend.deepep_high_throughput: "deepep_ht",
                  All2AllBackend.deepep_low_latency: "deepep_ll", All2AllBackend.mori: "mori",
                  All2AllBackend.nixl_ep: "nixl_ep", All2AllBackend.flashinfer_nvlink: "flashinfer_nvlink"}


@given(any_config)
def test_totality(config):
    decision = decide(config)  # an EngineError or any other exception fails the property
    assert decision.outcome in (Outcome.selected, Outcome.unsupported)
    assert (decision.backend is None) == (decision.outcome == Outcome.unsupported)
    candidates = {decision.backend} | set(decision.alternatives) | {r.backend for r in decision.rejections}
    assert candidates >= set(BACKENDS) or decision.failure_reason is not None


@given(any_config)
def test_soundness_every_constraint_of_the_winner_holds(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    assert violated_constraints(config, decision.backend) == []
    assert violated_constraints(config, decision.prepare_finalize) == []
    assert decision.rejections_of(decision.backend) == ()


@given(auto_config)
def test_priority_optimality(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    unrejected = [b for b in priority_order(decision) if not violated_constraints(config, b)]
    assert decision.backend == unrejected[0]
    assert list(decision.alternatives[:len(unrejected) - 1]) == unrejected[1:]


@given(configs(), st.sampled_from(BACKENDS))
def test_explicit_pin_fidelity(config, pin):
    decision = decide(config.model_copy(update={"features": config.features.model_copy(update={"backend": pin})}))
    if decision.outcome == Outcome.selected:
        assert (decision.backend, decision.selected_by) == (pin, SelectedBy.pinned)
    else:
        assert decision.backend is None and decision.requested == pin
        assert decision.rejections_of(pin) or decision.failure_reason is not None


@given(configs(), st.text(string.ascii_lowercase + "_", min_size=1, max_size=12))
def test_unknown_names_are_rejected_before_evaluation(config, name):
    assume(name not in BACKENDS and name != "auto")
    with pytest.raises(UnknownBackendError) as raised:
        DURABLE.decide(config.model_copy(update={"features": config.features.model_copy(update={"backend": name})}))
    assert raised.value.valid == BACKENDS


@given(forcing(any_config, "features", lora=True))
def test_lora_runs_on_lora_capable_experts_with_unquantized_activations(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    assert declared(decision.backend).lora
    assert decision.quant.quantized_by == QuantizedBy.none


@given(any_config)
def test_format_and_monolithic_agreement(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    dispatcher_format = RULES.dispatchers[decision.prepare_finalize].item.format
    assert decision.activation_format == dispatcher_format == declared(decision.backend).format
    assert (decision.activation_format == ActivationFormat.batched) == config.parallel.batched_format
    if decision.monolithic and config.quant.family.value == "unquantized":  # BF16 TRT-LLM: also behind AG/RS
        assert not config.parallel.eplb and (not config.parallel.use_all2all
                                             or config.parallel.all2all_backend.value == "allgather_reducescatter")
    elif decision.monolithic:
        assert not config.parallel.use_all2all and config.parallel.dp == 1 and not config.parallel.eplb


@given(any_config)
def test_dispatcher_non_triviality_keyed_on_all2all(config):
    decision = decide(config)
    parallel = config.parallel
    if decision.prepare_finalize is None:  # only a rejected dispatcher (package, vendor) may leave it unset
        assert decision.failure_reason not in (None, ReasonCode.no_dispatcher)
        return
    if parallel.use_all2all:
        assert decision.prepare_finalize == A2A_DISPATCHER[parallel.all2all_backend]
    elif parallel.dp > 1:
        assert decision.prepare_finalize == "allgather_reducescatter"
    else:  # TP+EP with dp == 1 uses an expert map and no dispatcher network
        assert decision.prepare_finalize == "local"


@given(any_config)
def test_expert_map_capability(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    if config.parallel.ep_size > 1 and decision.activation_format == ActivationFormat.standard:
        # the BF16 TRT-LLM kernel takes its local expert range itself (vLLM experts/trtllm_bf16_moe.py:310-312)
        assert declared(decision.backend).expert_map or (
            decision.backend == "flashinfer_trtllm" and config.quant.family.value == "unquantized")


@given(any_config)
def test_quantization_happens_exactly_once(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    quant = decision.quant
    assert quant.defer_input_quant == quant.expects_unquantized_inputs
    if not config.quant.activation_key:
        assert (quant.quantized_by, quant.scale_dim, quant.scale_type_size) == (QuantizedBy.none, 0, 0)
    elif quant.quantized_by == QuantizedBy.dispatcher:
        assert not quant.expects_unquantized_inputs and quant.dispatch_dtype == config.quant.activation_key.dtype.value
        assert quant.scale_dim >= 1
    elif quant.quantized_by == QuantizedBy.experts:
        assert quant.expects_unquantized_inputs and quant.dispatch_dtype == config.model.in_dtype.value
    else:  # weight-only experts ignore the activation key: nothing quantises, nothing is dequantised
        weight_only = RULES.rule("quant.weight_only_experts").item.backends   # Marlin, the OAI MXFP4 W4A16 kernels
        assert decision.backend in weight_only and quant.dispatch_dtype == config.model.in_dtype.value


@given(any_config)
def test_quant_pair_membership(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    scheme_rules = [r for r in RULES.constraints if r.id.endswith(".schemes") and
                    (r.item.applies_to == "all_backends" or decision.backend in r.item.applies_to)]
    assert scheme_rules, f"{decision.backend} has no declared scheme table"
    assert not set(violated_constraints(config, decision.backend)) & {r.id for r in scheme_rules}


@given(any_config)
def test_device_and_library_gating(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    for name in (decision.backend, decision.prepare_finalize):
        for package in RULES.component(name).item.packages:
            assert package in config.platform.packages
    vendor_only = {"aiter": "rocm", "xpu": "xpu", "torch_reference": "cpu", "flashinfer_trtllm": "cuda",
                   "deepgemm": "cuda", "marlin": "cuda", "cutlass_w4a8": "cuda"}
    if decision.backend in vendor_only:
        assert config.platform.vendor.value == vendor_only[decision.backend]
    if decision.backend == "aiter" and config.quant.family.value.startswith("mxfp4"):
        assert config.platform.arch == "gfx950"
    if decision.backend == "flashinfer_trtllm":
        assert config.platform.cc_family == 100


@given(near_boundary(256), near_boundary(256), st.sampled_from([1, 2, 16, 64, 128, 256]))
def test_round_up_is_monotone_idempotent_and_aligned(a, b, multiple):
    low, high = sorted((a, b))
    assert _round_up(low, multiple) <= _round_up(high, multiple)
    assert _round_up(_round_up(a, multiple), multiple) == _round_up(a, multiple)
    assert _round_up(a, multiple) % multiple == 0 and 0 <= _round_up(a, multiple) - a < multiple


@given(any_config)
def test_padding_bookkeeping(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    pad = decision.padding
    assert pad.hidden_padded == config.model.hidden_size + pad.hidden_pad
    assert pad.intermediate_padded == config.intermediate_per_partition + pad.intermediate_pad
    if decision.backend == "marlin" and config.quant.family.value == "mxfp4_w4a16":
        assert pad.hidden_padded % 256 == 0 and pad.intermediate_padded % 128 == 0


@given(forcing(any_config, "model", has_bias=True))
def test_bias_is_never_dropped(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    assert declared(decision.backend).bias


@given(st.lists(any_config, min_size=2, max_size=6), st.randoms(use_true_random=False))
def test_determinism_across_call_order_engines_and_rule_order(cfgs, rng):
    expected = [decide(c, REFERENCE).model_dump(exclude={"engine", "rules_hash"}) for c in cfgs]
    order = list(range(len(cfgs)))
    rng.shuffle(order)
    fresh = Engine(RULES, "durable")
    got = {i: decide(cfgs[i], fresh).model_dump(exclude={"engine", "rules_hash"}) for i in order}
    assert [got[i] for i in range(len(cfgs))] == expected
    shuffled = _shuffled_rules(rng)
    # The trace lists the rules in file order (the order they apply), so it follows a reordering: only its
    # contents must not change.
    assert [_trace_as_set(decide(c, Engine(shuffled, "reference")).model_dump(exclude={"engine", "rules_hash"}))
            for c in cfgs] == [_trace_as_set(e) for e in expected]


def _trace_as_set(record: dict) -> dict:
    return {**record, "trace": sorted(record["trace"])}


def _shuffled_rules(rng: random.Random) -> RuleSet:
    """The same rules with constraints, dispatch and plan rules in another order (priorities keep
    their order: 'first matching order, then demotions in file order' is their documented meaning)."""
    copy = RuleSet(files=RULES.files, backends=RULES.backends, dispatchers=RULES.dispatchers,
                   constraints=rng.sample(RULES.constraints, len(RULES.constraints)),
                   priorities=list(RULES.priorities), dispatch=rng.sample(RULES.dispatch, len(RULES.dispatch)),
                   plan=rng.sample(RULES.plan, len(RULES.plan)), content=RULES.content + [["shuffled", rng.random()]])
    return copy


@given(auto_config, st.data())
def test_monotonic_under_removing_a_non_selected_backend(config, data):
    decision = decide(config)
    assume(decision.outcome == Outcome.selected)
    others = [b for b in BACKENDS if b != decision.backend]
    removed = data.draw(st.sampled_from(others))
    smaller = Engine(_without_backend(removed), "reference")
    after = decide(config, smaller)
    assert (after.backend, after.prepare_finalize, after.quant) == (decision.backend, decision.prepare_finalize,
                                                                    decision.quant)


_WITHOUT: dict[str, RuleSet] = {}


def _without_backend(name: str) -> RuleSet:
    """The default rules with one backend removed from the declarations, priorities and rules."""
    if name not in _WITHOUT:
        def keep(rule):
            targets = rule.item.applies_to if hasattr(rule.item, "applies_to") else None
            return not (isinstance(targets, list) and targets == [name])

        def drop_from(rule):
            item = rule.item
            if getattr(item, "applies_to", None) and isinstance(item.applies_to, list) and name in item.applies_to:
                item = item.model_copy(update={"applies_to": [b for b in item.applies_to if b != name]})
            if getattr(item, "order", None):
                item = item.model_copy(update={"order": [b for b in item.order if b != name]})
            return type(rule)(item, rule.source, rule.when, rule.require)
        _WITHOUT[name] = RuleSet(
            files=RULES.files, backends={k: v for k, v in RULES.backends.items() if k != name},
            dispatchers=RULES.dispatchers, constraints=[drop_from(r) for r in RULES.constraints if keep(r)],
            priorities=[drop_from(r) for r in RULES.priorities], dispatch=RULES.dispatch,
            plan=[r for r in RULES.plan if r.item.backends != [name]], content=RULES.content + [["without", name]])
    return _WITHOUT[name]


@given(configs(pins=BACKENDS))
def test_error_informativeness_every_suggestion_is_selectable(config):
    decision = decide(config)
    assume(decision.outcome == Outcome.unsupported and decision.requested != "auto")
    marker = "Eligible alternatives: "
    assume(marker in decision.error)
    suggested = decision.error.split(marker, 1)[1]
    for name in ([] if suggested == "none" else suggested.split(", ")):
        pinned = config.model_copy(update={"features": config.features.model_copy(update={"backend": name})})
        assert decide(pinned).backend == name


# Fields the assembly reads directly (sizes for padding, the input dtype for dispatch, the pin).
_ASSEMBLY_READS = {"model.hidden_size", "model.moe_intermediate_size", "model.in_dtype", "features.backend",
                   "parallel.tp", "parallel.dp"}


@given(auto_config, st.data())
def test_metamorphic_unread_fields_never_change_the_decision(config, data):
    read = _fields_read_by_rules()
    unread = {"model.num_experts": st.integers(1, 2048), "model.top_k": st.integers(1, 16),
              "model.routing": st.sampled_from(["softmax", "softmax_renormalize", "deepseek_v3", "llama4", "sigmoid"]),
              "parallel.eplb": st.booleans(), "features.batch_invariant": st.booleans(),
              # the layer's math only (kernel scalars): no rule may read them
              **{f"model.{name}": st.floats(0.01, 100.0) for name in ModelShape.MATH_ONLY_FIELDS}}
    candidates = sorted(path for path in unread if path not in read and path not in _ASSEMBLY_READS)
    assume(candidates)
    path = data.draw(st.sampled_from(candidates))
    section, field = path.split(".")
    value = data.draw(unread[path])
    data_dict = config.model_dump(mode="json")
    data_dict[section][field] = value
    if data_dict["model"]["top_k"] > data_dict["model"]["num_experts"]:
        data_dict["model"]["top_k"] = data_dict["model"]["num_experts"]
    changed = type(config).model_validate(data_dict)
    assert decide(changed).model_dump(exclude={"config"}) == decide(config).model_dump(exclude={"config"})


def _fields_read_by_rules() -> set[str]:
    from moerules.engine.expr import fields_of
    read = set()
    for rule in RULES.rules():
        for expr in (rule.when, rule.require):
            if expr is not None:
                read |= fields_of(expr)
    return read
