"""An emulator of vLLM's OpenAI-compatible server with injectable nondeterminism and faults."""

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
