"""durable-rules' fixed capacities, and what one compiled condition costs against them.

durable-rules 2.0.28 sizes its Rete network with compile-time constants and does not
degrade gracefully past them: one too many pending alpha nodes aborts the process, a full
child table hangs it with the GIL held, one too many rules on a node fails with a bare
error code. The compiler therefore knows each limit (tests/engine/test_capacity.py
exercises both sides of every edge on the real engine), prices every condition, packs
rules into shards that stay inside the limits, and refuses a single rule that cannot fit
before durable ever sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

# src/rules/events.c MAX_STACK_SIZE: alpha nodes waiting on one assert's depth-first walk.
# Pushing the 65th fails assert_fact with error 303; deleting that sid, in which no action
# ever ran, then crashes the process.
STACK_SLOTS = 64
# src/rules/rules.h NEXT_BUCKET_LENGTH: the open-addressing child table of one alpha node.
# Its lookup loops have no exit when all 512 slots are taken, so 512 children hang.
CHILD_SLOTS = 511
# src/rules/rules.h BETA_LIST_LENGTH: rules ending on one alpha node, i.e. rules with one and
# the same condition; 256 segfaults at the first assert, 257 fails with error 108. The compiler
# merges rules with identical conditions into one, so at most one rule ends on any node.
BETA_SLOTS = 255
# src/rules/rules.h NEXT_LIST_LENGTH: existence tests and `$or` joins hanging off one node;
# 128 segfaults at the first assert, 129 fails create_ruleset with error 107.
ABSENCE_SLOTS = 127
# src/rules/rete.h MAX_SEQUENCE_EXPRESSIONS: `$and`/`$or` markers one rule's beta node keeps
# (two per group); the 32nd fails create_ruleset with error 113.
EXPRESSION_SLOTS = 31
# src/rules/state.h MAX_OBJECT_PROPERTIES (255): properties of one fact, nested ones
# flattened, sid and t included; durable keeps two for itself, so 254 fails with error 302.
FACT_PROPERTIES = 253
# src/rules/rete.c MAX_ACTIONS: rules in one ruleset (error 106 beyond).
RULE_SLOTS = 4096

# What one shard of rules may spend, with a margin for the tag and shard nodes above it.
SHARD_STACK = STACK_SLOTS - 4
SHARD_CHILDREN = CHILD_SLOTS - 11
SHARD_ABSENCES = ABSENCE_SLOTS - 7
# Paths through one condition that can match one fact at once: durable walks (and fires)
# every one of them, so chained non-exclusive `or`s would multiply the work of an assert.
PATHS_PER_RULE = 64


@dataclass(frozen=True)
class Cost:
    """What one condition (durable JSON) uses of a shard's budget."""

    stack: int      # stack entries it can keep pending at once
    children: int   # tests it can add under one node (bounded by its test count)
    absences: int   # `$nex` tests and `$or` joins (each `$or` ends in a hidden `$nex` node)
    groups: int     # `$and`/`$or` groups
    paths: int      # alternative paths that can match one fact at once

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.stack + other.stack, self.children + other.children, self.absences + other.absences,
                    self.groups + other.groups, max(self.paths, other.paths))

    def fits_shard(self) -> bool:
        return self.stack <= SHARD_STACK and self.children <= SHARD_CHILDREN and self.absences <= SHARD_ABSENCES

    def excesses(self) -> list[str]:
        """Why one rule alone cannot be compiled: each limit it exceeds, with the limit."""
        checks = [(self.stack, SHARD_STACK, "alternatives that can match at once"),
                  (self.children, SHARD_CHILDREN, "comparisons"),
                  (self.absences, SHARD_ABSENCES, "'or' groups and absence tests"),
                  (2 * self.groups, EXPRESSION_SLOTS, "and/or group markers (two per group)"),
                  (self.paths, PATHS_PER_RULE, "paths that can match one config at once")]
        return [f"{value} {what} (durable-rules allows {limit})" for value, limit, what in checks if value > limit]


def cost(condition: dict) -> Cost:
    """The price of a condition; an `$and` dict of several keys is a conjunction of its keys."""
    parts = [_cost_of(key, value) for key, value in condition.items()]
    return parts[0] if len(parts) == 1 else _chain(parts, groups=1)


def _cost_of(key: str, value) -> Cost:
    if key == "$and":
        return _chain([cost(item) for item in value], groups=1)
    if key == "$or":
        return _alternatives(value)
    return Cost(1, 1, int(key == "$nex"), 0, 1)


def _chain(parts: list[Cost], groups: int) -> Cost:
    """A conjunction is a chain of nodes: each link leaves its pending alternatives behind."""
    stack = sum(part.stack - 1 for part in parts) + 1
    paths = 1
    for part in parts:
        paths *= part.paths
    return Cost(stack, sum(p.children for p in parts), sum(p.absences for p in parts),
                groups + sum(p.groups for p in parts), paths)


def _alternatives(items: list[dict]) -> Cost:
    """A disjunction: every disjunct that matches is pushed. Equalities of one field with
    different values exclude each other (an `in` list), so such a group counts once."""
    exclusive: dict[str, list[Cost]] = {}
    others: list[Cost] = []
    for item in items:
        field = _equality_field(item)
        (exclusive.setdefault(field, []) if field else others).append(cost(item))
    units = others + [max(group, key=lambda c: c.stack) for group in exclusive.values()]
    return Cost(sum(u.stack for u in units), sum(c.children for c in others) + sum(
        len(group) for group in exclusive.values()), 1 + sum(c.absences for c in others),
        1 + sum(c.groups for c in others), sum(u.paths for u in units))


def _equality_field(condition: dict):
    """The field of a plain `field: value` test, else None."""
    if len(condition) == 1:
        (key, value), = condition.items()
        if not key.startswith("$") and not isinstance(value, dict):
            return key
    return None
