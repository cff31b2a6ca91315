"""durable-rules and the reference evaluator run the same compiled rules; their Decisions
must agree exactly (outcome, winner, alternatives, rejections with rule ids, plan, trace)."""

from __future__ import annotations

from hypothesis import given

from moerules.testing import configs

from invariants import BACKENDS, DURABLE, REFERENCE, decide


@given(configs(pins=BACKENDS))
def test_durable_and_reference_agree_on_random_configs(config):
    durable, reference = decide(config, DURABLE), decide(config, REFERENCE)
    assert (durable.engine, reference.engine) == ("durable", "reference")
    assert durable.model_dump(exclude={"engine"}) == reference.model_dump(exclude={"engine"})
