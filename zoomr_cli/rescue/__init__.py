"""KV-Rescue (the KV-Rescue paper): an evicted base model and a full-KV helper propose steps, a scorer commits one.

:mod:`.loop` (the step loop), :mod:`.engine` (one role's model and committed state), :mod:`.degeneration`
(early abort of degenerate base candidates), :mod:`.scorers` (PRM, or the helper's log-likelihood),
:mod:`.events` and :mod:`.transcript` (what happened, for views and records), :mod:`.plan` (settings resolved
before any model loads) and :mod:`.runner` (one run over loaded models). No typer/rich import.
"""
