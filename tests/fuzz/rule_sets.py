"""Valid but adversarial rule sets for the engine fuzz suite.

Hypothesis draws the *shape* of a rule set (how many backends, constraints, equality tests,
`or` chains, list lengths, plan and priority rules, and a seed); a seeded generator writes
the bulk from that shape. Drawing hundreds of conditions node by node through hypothesis
would cost more than deciding them, and the knobs still shrink: a failure reduces to few,
small rule groups.

Every condition is well typed (fields from `config_fields()`, values of the field's kind),
so most rule sets load; what they probe is the compiler's capacity model and the two engines.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import yaml
from hypothesis import strategies as st

from moerules.decision import ReasonCode
from moerules.engine.fields import config_fields
from moerules.engine.loader import load_rules
from moerules.testing import ARCHS

SHIPPED = load_rules()
SHIPPED_BACKENDS = sorted(SHIPPED.backends)
FIELDS = [spec for spec in config_fields().values()]
INT_FIELDS = [spec.path for spec in FIELDS if spec.kind == "int"]
INT_SPEC = config_fields()["model.hidden_size"]
# Values configs really take (sizes near 256-multiples, small degrees), so tests match now and then.
INTS = [0, 1, 2, 4, 8, 16, 32, 64, 89, 90, 100, 120, 128, 256, 512, 1024, 1408, 2048, 2880, 4096, 7168, 14336]
ARCH_NAMES = sorted({arch for archs in ARCHS.values() for arch in archs})
REASONS = [r.value for r in ReasonCode if r.value not in ("not_in_priority", "no_dispatcher")]
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's writer: a large file in a tenth of the time
LEAVES = 48  # tests per generated condition: past durable's 500 comparisons with long lists, never megabytes
CAPABILITIES = ["lora", "bias", "expert_map", "monolithic", "batch_invariant"]
# Complete quantization plans (a quantization rule sets exactly these four keys).
QUANT_SETS = [{"quantized_by": "none", "dispatch_dtype": "input", "scale_dim": 0, "scale_type_size": 0},
              {"quantized_by": "experts", "dispatch_dtype": "input", "scale_dim": 0, "scale_type_size": 0},
              {"quantized_by": "dispatcher", "dispatch_dtype": "quant.activation.dtype",
               "scale_dim": "model.hidden_groups_128", "scale_type_size": 4}]
PLACEMENT_SETS = [{"expects_unquantized_inputs": True}, {"expects_unquantized_inputs": False},
                  {"round_up_hidden": 256}, {"round_up_intermediate": 128, "round_up_hidden": 64},
                  {"weight_block": 32}, {"expert_placement": "round_robin"}]


@dataclass(frozen=True)
class Shape:
    """What one generated rule file holds; every count may be 0."""

    seed: int
    backends: int          # extra backends (kernel torch.reference, random capabilities)
    constraints: int       # random constraints, deep and wide conditions
    depth: int             # nesting depth of their conditions
    width: int             # operands per and/or
    in_length: int         # length of `in` / `not in` lists
    long_lists: int        # constraints whose `when` is one `in` list of in_length values
    equalities: int        # constraints testing one int field for equality with distinct values
    or_chains: int         # constraints whose `when` is a chain of non-exclusive `or`s
    chain_length: int      # disjuncts per chain
    capability_rules: int  # all_backends constraints over backend.* capabilities
    priorities: int        # order / promote / demote rules
    plans: int             # plan rules (placement and quantization)


class Writer:
    """Writes well-typed rule-file items from a seeded generator."""

    def __init__(self, shape: Shape):
        self.shape, self.rng = shape, random.Random(shape.seed)
        self.backends = [f"fz_b{i}" for i in range(shape.backends)]
        self.all_backends = SHIPPED_BACKENDS + self.backends

    def value(self, spec) -> str:
        rng = self.rng
        if spec.kind == "int":
            return str(rng.choice(INTS) if rng.random() < 0.8 else rng.randint(-10, 1 << 20))
        if spec.kind == "bool":
            return rng.choice(["true", "false"])
        return rng.choice(spec.values if spec.kind == "enum" else ARCH_NAMES)

    def distinct_values(self, spec, count: int) -> list[str]:
        """Up to `count` distinct values (the loader refuses a repeated one); fewer if the field has fewer."""
        if spec.kind == "int":
            return [str(v) for v in self.rng.sample(INTS + list(range(20_000, 20_000 + count)), count)]
        pool = ["true", "false"] if spec.kind == "bool" else list(spec.values if spec.kind == "enum" else ARCH_NAMES)
        return self.rng.sample(pool, min(count, len(pool)))

    def test(self, backend_fields: bool) -> str:
        rng = self.rng
        if backend_fields and rng.random() < 0.3:
            return self.capability_test()
        spec = rng.choice(FIELDS)
        if spec.kind == "bool" and rng.random() < 0.5:
            return rng.choice(["", "not "]) + spec.path
        if rng.random() < 0.25:  # a long list now and then: every one long makes megabyte files
            length = max(1, self.shape.in_length) if rng.random() < 0.1 else rng.randint(1, min(8, max(1, self.shape.in_length)))
            values = ", ".join(self.distinct_values(spec, length))
            return f"{spec.path} {rng.choice(['in', 'not in'])} [{values}]"
        ops = ["<", "<=", ">", ">=", "==", "!="] if spec.kind == "int" else ["==", "!="]
        return f"{spec.path} {rng.choice(ops)} {self.value(spec)}"

    def capability_test(self) -> str:
        rng = self.rng
        choice = rng.random()
        if choice < 0.6:
            return rng.choice(["", "not "]) + "backend." + rng.choice(CAPABILITIES)
        if choice < 0.8:
            return f"backend.format {rng.choice(['==', '!='])} {rng.choice(['standard', 'batched'])}"
        return f"backend.id in [{', '.join(rng.sample(self.all_backends, rng.randint(1, 4)))}]"

    def condition(self, depth: int, backend_fields: bool = False) -> str:
        """A random and/or/not tree `depth` levels deep, `width` operands per group at most,
        LEAVES tests at most (width ** depth would reach thousands)."""
        self.leaves = LEAVES
        return self._tree(depth, backend_fields)

    def _tree(self, depth: int, backend_fields: bool) -> str:
        rng = self.rng
        if depth == 0 or self.leaves <= 1 or rng.random() < 0.2:
            self.leaves -= 1
            return self.test(backend_fields)
        parts = [self._tree(depth - 1, backend_fields) for _ in range(rng.randint(1, max(1, self.shape.width)))]
        text = f" {rng.choice(['and', 'or'])} ".join(f"({part})" for part in parts)
        return f"not ({text})" if rng.random() < 0.2 else text

    def constraint(self, rule_id: str, when: str | None, require: str, all_backends: bool = False) -> dict:
        rng = self.rng
        targets = "all_backends" if all_backends else rng.sample(self.all_backends, rng.randint(1, 3))
        item = {"id": rule_id, "applies_to": targets, "require": require, "reason": rng.choice(REASONS),
                "message": rng.choice(["fuzz", "fuzz {backend} at {model.hidden_size}", "{platform.arch}"]),
                "fallback": rng.random() < 0.2}
        return {**item, "when": when} if when else item

    def rule_file(self) -> dict:
        shape, rng = self.shape, self.rng
        backends = [{"id": name, "kernel": "torch.reference", "description": "fuzz",
                     **{cap: rng.random() < 0.5 for cap in CAPABILITIES if rng.random() < 0.3},
                     **({"format": "batched"} if rng.random() < 0.1 else {})} for name in self.backends]
        constraints = [self.constraint(f"fz.c{i}", self.condition(shape.depth) if rng.random() < 0.7 else None,
                                       self.condition(shape.depth)) for i in range(shape.constraints)]
        field = rng.choice(INT_FIELDS)
        constraints += [self.constraint(f"fz.eq{i}", f"{field} == {v}", self.test(False))
                        for i, v in enumerate(rng.sample(range(1 << 16), shape.equalities))]
        constraints += [self.constraint(f"fz.in{i}", f"{rng.choice(INT_FIELDS)} in "
                                        f"[{', '.join(self.distinct_values(INT_SPEC, max(1, shape.in_length)))}]",
                                        self.test(False)) for i in range(shape.long_lists)]
        constraints += [self.constraint(f"fz.or{i}", " or ".join(
            f"{rng.choice(INT_FIELDS)} > {rng.choice(INTS) + j}" for j in range(shape.chain_length)),
            self.test(False)) for i in range(shape.or_chains)]
        constraints += [self.constraint(f"fz.cap{i}", self.condition(min(shape.depth, 2)) if rng.random() < 0.5 else None,
                                        self.condition(min(shape.depth, 2), backend_fields=True), all_backends=True)
                        for i in range(shape.capability_rules)]
        data = {"version": 1, "backends": backends, "constraints": constraints,
                "priorities": [self.priority(i) for i in range(shape.priorities)],
                "plan": [self.plan(i) for i in range(shape.plans)]}
        return {key: value for key, value in data.items() if value}

    def priority(self, index: int) -> dict:
        rng = self.rng
        action = rng.choice(["order", "promote", "demote"])
        names = rng.sample(self.all_backends, rng.randint(1, min(len(self.all_backends), 40)))
        item = {"id": f"fz.p{index}", action: names}
        return {**item, "when": self.condition(min(self.shape.depth, 2))} if rng.random() < 0.8 else item

    def plan(self, index: int) -> dict:
        rng = self.rng
        item = {"id": f"fz.plan{index}", "set": rng.choice(QUANT_SETS + PLACEMENT_SETS)}
        if rng.random() < 0.7:
            item["backends"] = rng.sample(self.all_backends, rng.randint(1, 3))
        if rng.random() < 0.7:
            item["when"] = self.condition(min(self.shape.depth, 2))
        return item


def render(shape: Shape) -> str:
    return yaml.dump(Writer(shape).rule_file(), Dumper=DUMPER, sort_keys=False, width=1 << 16)


def _count(bound: int) -> st.SearchStrategy[int]:
    """Mostly small, one draw in ten up to `bound`: cases with every size large would each cost a second."""
    small = st.integers(0, min(bound, 8))
    return st.one_of(*[small] * 9, st.integers(0, bound))


SEEDS = st.integers(0, 2 ** 32 - 1)


def shapes() -> st.SearchStrategy[Shape]:
    """Everything at once, mostly small. The wide `or` chains stay under 300 rules (one shard
    each) to keep a case fast; edge_shapes() goes past one node's 511 shards."""
    return st.builds(Shape, seed=SEEDS, backends=_count(300), constraints=_count(120), depth=st.integers(0, 5),
                     width=st.integers(1, 6), in_length=_count(700), long_lists=_count(3), equalities=_count(600),
                     or_chains=_count(300), chain_length=st.integers(1, 70), capability_rules=_count(40),
                     priorities=_count(20), plans=_count(30))


def _focus(**knobs) -> st.SearchStrategy[Shape]:
    """A small rule file with a few knobs at a durable capacity's edge."""
    defaults = dict(seed=SEEDS, backends=st.integers(0, 4), constraints=st.integers(0, 4), depth=st.integers(0, 3),
                    width=st.integers(1, 3), in_length=st.integers(1, 8), long_lists=st.just(0),
                    equalities=st.just(0), or_chains=st.just(0), chain_length=st.integers(1, 8),
                    capability_rules=st.integers(0, 3), priorities=st.integers(0, 3), plans=st.integers(0, 3))
    return st.builds(Shape, **{**defaults, **knobs})


def edge_shapes() -> st.SearchStrategy[Shape]:
    """Rule files at each of durable's edges (engine/capacity.py): comparisons under one node
    (500), paths and alternatives of one rule (64, 60), rules per shard, shards, components."""
    around = lambda edge, spread=12: st.integers(edge - spread, edge + spread)  # noqa: E731
    return st.one_of(
        _focus(long_lists=st.integers(1, 3), in_length=around(497)),         # one `in` list at 500 comparisons
        _focus(equalities=around(500, 40)),                                  # equality tests of one field
        _focus(or_chains=st.integers(1, 3), chain_length=around(60, 6)),     # paths / alternatives of one rule
        _focus(or_chains=st.integers(1, 600), chain_length=st.integers(20, 40)),  # shards past one node's 511
        _focus(backends=st.integers(200, 400), capability_rules=st.integers(1, 40)),  # many components
        _focus(depth=st.integers(4, 6), width=st.integers(2, 6), constraints=st.integers(1, 40)))  # deep and wide
