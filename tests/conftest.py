"""Hypothesis profiles: `ci` (default, bounded) and `deep` (>= 100k examples per property).

    pytest tests/properties --hypothesis-profile=deep
"""

from hypothesis import HealthCheck, settings

# Properties about selected decisions `assume()` a selection; many drawn configs are (rightly)
# unsupported, so filtering is expected.
_QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True, suppress_health_check=_QUIET)
settings.register_profile("deep", max_examples=100_000, deadline=None, suppress_health_check=_QUIET)
settings.load_profile("ci")
