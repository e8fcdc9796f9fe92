"""turboquant: turboquant.cpp from Python.

A model on the CPU (or a CUDA GPU) with a TurboQuant-compressed KV cache, the reference system's prompt
cache API, and the codec on NumPy arrays. Everything is computed by the C++ runtime (the compiled
extension ``turboquant._turboquant``); this package only shapes its input and output.

    import turboquant as tq
    model = tq.load("models/demo", kv="k8v3")
    print(model.generate("It is a truth universally acknowledged", max_tokens=40, temperature=0))

See python/README.md.
"""

from . import _turboquant
from ._turboquant import CancelToken, Error
from . import codec
from ._model import Model, load
from ._cache import (
    PromptCache,
    convert_cache_to_turboquant,
    enable_fused_attend,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

__version__ = "0.1.0"

__all__ = [
    "CancelToken",
    "Error",
    "Model",
    "PromptCache",
    "codec",
    "convert_cache_to_turboquant",
    "enable_fused_attend",
    "load",
    "load_prompt_cache",
    "make_prompt_cache",
    "save_prompt_cache",
]
