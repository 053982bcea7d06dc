"""tqserve: an LLM inference engine with a TurboQuant-compressed paged KV cache."""

__version__ = "0.1.0"

from tqserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__all__ = ["SamplingParams", "RequestOutputKind", "LLM", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import tqserve` stays cheap.
    if name == "LLM":
        from tqserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
