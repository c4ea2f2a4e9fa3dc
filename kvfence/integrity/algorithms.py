"""The names of the page digest algorithms a handoff manifest may carry.

What it knows: the two names (`xxh3_64` for host-visible pools, `mlh62` for device pools) and the tuple decode
verifies with, as plain strings, so that the processes that only name an algorithm (the disaggregated router and
its integrity records) import them without torch. What it does not know: how either digest is computed
(`kvfence.integrity.digest`, `kvfence.integrity.device_digest`).
"""

from __future__ import annotations

DIGEST_ALGORITHM = "xxh3_64"  # host-visible pools (and the default the record shows before a manifest names one)
MLH_ALGORITHM = "mlh62"  # device pools: torch ops where the pages live (`integrity.device_digest`)
DIGEST_ALGORITHMS = (DIGEST_ALGORITHM, MLH_ALGORITHM)  # what decode can verify; a manifest naming another is refused
