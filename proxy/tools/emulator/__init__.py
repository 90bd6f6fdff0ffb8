"""An emulator of vLLM's OpenAI-compatible server with injectable nondeterminism and faults.

Each cause of divergence has its own flag; with only that flag on, everything else is
deterministic and bit-identical run to run (text and logprobs). Greedy requests only.

=============  ============================================  ===================================
cause          flag (EmulatorConfig field)                   injection record kind(s)
=============  ============================================  ===================================
intrinsic      --flip-probability P (flip_probability)       flip (random per request, also
                                                             alone in flight)
batch          --batch-divergence-slope S                    batch_drift, batch_divergence
               (batch_divergence_slope)                      (never at 1 request in flight)
prefix_cache   --warm-cache-divergence P                     prefix_cache (warm != cold; off
               (warm_cache_divergence)                       with --no-enable-prefix-caching)
speculative    --speculative --speculative-divergence P      speculative (differs from the same
               (speculative_divergence)                      emulator without --speculative)
recipe_change  restart with another --vllm-version/--model   none (the recipe itself changed)
=============  ============================================  ===================================

Prompts affected by prefix_cache and speculative are chosen by a hash of the prompt (a share P),
and the divergent position (one of the first ten tokens, the runner-up taken) too. The records
are read with ``GET /emulator/injections`` (``EmulatorServer.injections()`` in tests; one
request's with ``?request_id=`` / ``injections(request_id)``, the X-Request-Id it was sent with)
and cleared with ``POST /emulator/reset``. The knobs combine in one emulator (batch with cache,
speculation on a batched engine, flips on a reference): each record names the one effect it is,
so a test knows per request which effects changed its answer.
"""

from .app import build_emulator_app
from .config import KNOBS_HEADER, EmulatorConfig, FaultKind, KnobsError, LoopChannel, ReasoningStyle
from .injections import EmulatorState, InjectionKind, InjectionRecord
from .server import EmulatorServer

__all__ = [
    "KNOBS_HEADER",
    "EmulatorConfig",
    "EmulatorServer",
    "EmulatorState",
    "FaultKind",
    "InjectionKind",
    "InjectionRecord",
    "KnobsError",
    "LoopChannel",
    "ReasoningStyle",
    "build_emulator_app",
]
