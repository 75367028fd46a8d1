"""Third-party warnings tripod knows to be harmless, silenced by the entry points (`apply_megatron_patches`).

megatron-core 0.16.1 warns "Transformer Engine and Apex are not installed" from four modules when they are imported
without TE and Apex (its optimizer, optimizer.py, clip_grads.py and megatron_fsdp's mixed_precision.py), and "Apex is
not installed" from models/backends.py, so every `tripod plan` / `tripod train` used to print them four or five times
within its own output. On CPU neither can exist, and on a GPU machine without them megatron takes the same fallbacks
(torch's optimizers and norms, its local multi-tensor ops; tripod builds TE layer specs only where TE is installed:
parallel/model.py), so the warnings say nothing a user can act on; tripod prints them not at all.

`TRIPOD_DEBUG=1` leaves every warning visible (as it shows tracebacks). A warning that is not in `KNOWN` is printed as
Python prints it.
"""
from __future__ import annotations

import os
import warnings

# (message regex matched at the start of the message, module regex, why it is harmless)
KNOWN: tuple[tuple[str, str, str], ...] = (
    ("Transformer Engine and Apex are not installed", r"megatron\.",
     "megatron falls back to torch's optimizers and its local multi-tensor ops: what tripod runs without TE/Apex"),
    ("Apex is not installed", r"megatron\.",
     "megatron's models/backends.py falls back to torch's norms: tripod's local layer spec builds those anyway"),
)


def quiet_known_warnings() -> None:
    """Ignore the `KNOWN` warnings in this process (idempotent: warnings keeps one copy of an identical filter)."""
    if os.environ.get("TRIPOD_DEBUG"):
        return
    for message, module, _why in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
