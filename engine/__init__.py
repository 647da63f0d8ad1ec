"""decider's scoring core: load a Qwen3.5-family model, prepare question schemas once, score states fast.

Knows nothing of Kafka.  See `SchemaEngine` for the request path and `engine.reference.score_full` for the oracle.
"""
from engine import cublas_workspace

cublas_workspace.configure()    # before any GEMM of the process: torch reads it once (engine.cublas_workspace)

from engine.errors import DeviceUnavailableError, InputError, KernelsUnavailableError, ModelLoadError
from engine.fingerprint import Fingerprint
from engine.loader import Engine
from engine.prompt import MAX_OPTIONS, QWEN_CHAT, ChatTemplate
from engine.schema_engine import PreparedSchema, SchemaEngine, TokenizedState
from engine.scores import PendingScores, Scores, StateScores

__all__ = ["KernelsUnavailableError", "Engine", "SchemaEngine", "PendingScores", "PreparedSchema", "TokenizedState", "Scores", "StateScores", "Fingerprint",
           "MAX_OPTIONS", "ChatTemplate", "QWEN_CHAT", "InputError", "ModelLoadError", "DeviceUnavailableError"]
