"""The settings of one decode worker, as a frozen dataclass checked when made.

What it knows: the transfer backend, the data-plane listen address, the handoff deadline, whether handoffs are
verified, strict quarantine, the data connection's idle timeout and the grammar budget, with their defaults (which
`kvfence.commands.args` shows as the flags' defaults). Plain Python, so the flag tables import it without the
decode worker (torch). What it does not know: what decode does with them (`kvfence.disagg.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.disagg.config_checks import require_choice, require_positive
from kvfence.engine.structured_output import GrammarBudget
from kvfence.transfer.transfer_config import TRANSFER_BACKENDS


@dataclass(frozen=True)
class DecodeConfig:
    transport: str = "tcp"  # the transfer backend, one of TRANSFER_BACKENDS (field name kept: worker_main sets it)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # the launcher passes a free port explicitly; 0 only in tests
    deadline_s: float = 60.0  # waiting for pages, the transfer once it started, its quarantine (each)
    verify: bool = True  # False ONLY to demonstrate what the checks protect against
    strict: bool = False  # poison quarantined and released pages
    io_timeout_s: float = 10.0  # a data connection that moves no byte this long in the middle of a frame is dropped
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)  # response_format compiles, off the loop

    def __post_init__(self) -> None:
        require_choice(self, "transport", TRANSFER_BACKENDS)
        require_positive(self, "deadline_s")
        require_positive(self, "io_timeout_s")
