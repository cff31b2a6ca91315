"""Probe one of durable-rules' fixed capacities at a given size, in a process of its own.

    python durable_probe.py SCENARIO N    ->  prints "ok" or "error <code>" (or hangs, or dies)

Run by test_capacity.py on both sides of each edge, so the constants in
engine/capacity.py are facts about the installed durable-rules, not beliefs.
"""

import json
import re
import sys

import durable_rules_engine as c


def _rules(scenario: str, n: int) -> tuple[dict, dict]:
    """(ruleset, fact) for a scenario: n of the thing that scenario counts."""
    if scenario == "stack":  # n rules that all match one fact: n alpha nodes pending at once
        return {f"r{i}": {"all": [{"m": {"$and": [{"t": "x"}, {"$gt": {"v": i}}]}}]} for i in range(n)}, {"v": n}
    if scenario == "children":  # n equality tests on one field under one node; the fact matches none
        return {f"r{i}": {"all": [{"m": {"$and": [{"t": "x"}, {"v": i}]}}]} for i in range(n)}, {"v": -1}
    if scenario == "absences":  # n existence tests under one node; the fact has every field, so none is pending
        return ({f"r{i}": {"all": [{"m": {"$and": [{"t": "x"}, {"$nex": {f"f{i}": 1}}]}}]} for i in range(n)},
                {f"f{i}": 1 for i in range(n)})
    if scenario == "betas":  # n rules with one and the same condition: n beta nodes on one alpha node
        return {f"r{i}": {"all": [{"m": {"$and": [{"t": "x"}, {"v": 1}]}}]} for i in range(n)}, {"v": 1}
    if scenario == "groups":  # one rule with n and/or groups (one $and holding n-1 $or)
        ors = [{"$or": [{f"a{i}": 1}, {f"b{i}": 1}]} for i in range(n - 1)]
        return {"r": {"all": [{"m": {"$and": [{"t": "x"}, *ors]}}]}}, {f"a{i}": 1 for i in range(n - 1)}
    if scenario == "properties":  # a fact of n properties, sid and t included
        return {"r": {"all": [{"m": {"t": "x"}}]}}, {f"p{i}": i for i in range(n - 2)}
    if scenario == "rules":
        return {f"r{i}": {"all": [{"m": {"$and": [{"t": "x"}, {"v": i % 300}, {"w": i}]}}]} for i in range(n)}, {"v": 1}
    raise SystemExit(f"unknown scenario {scenario}")


def main() -> None:
    scenario, n = sys.argv[1], int(sys.argv[2])
    rules, fact = _rules(scenario, n)
    try:
        handle = c.create_ruleset("probe", json.dumps(rules))
        code, state = c.assert_fact(handle, json.dumps({"sid": "1", "t": "x", **fact}))
        result = c.start_action_for_state(handle, state) if code == 0 else None
        while result:
            result = c.complete_and_start_action(handle, state)
    except c.error as error:
        print("error", re.findall(r"\d+", str(error))[-1])
        return
    print("ok")


if __name__ == "__main__":
    main()
