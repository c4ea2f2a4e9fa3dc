"""What the first build of the native kernels costs, in words: one string the build's warning and the flag help share.

What it knows: the estimate only, as plain text, so that `kvfence.config` can show it in `--kernels`' help without
importing the kernels' module (which imports torch: the launcher and the router of a deployment never load it). What
it does not know: how the kernels are built or cached (`kvfence.models.native_kernels`).
"""

from __future__ import annotations

NATIVE_BUILD_ESTIMATE = "30-60 s on two idle cores, a few minutes on a busy machine"  # how long the first build takes
