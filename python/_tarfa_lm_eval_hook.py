"""Makes lm-eval's bare ``lm_eval --model tarfa`` find tarfa's model (``tarfa.lm_eval:TarfaLM``).

lm-eval (every release on PyPI up to 0.4.13) registers models only by import: its registry reads
no plugin entry points, and ``--include_path`` is for tasks. So the wheel installs
``tarfa-lm-eval.pth``, whose one line imports this module at interpreter start. It imports nothing
(``sys`` and ``os`` are loaded already) and only puts a finder at the front of ``sys.meta_path``
that answers for one module name, ``lm_eval.api.registry``; it returns None for every other
name, so other imports cost one string comparison. When lm-eval's registry module is imported,
the finder lets the other finders find it, and once the module has run:

- lm-eval >= 0.4.10 (a ``model_registry`` with lazy placeholders): registers ``tarfa`` as the
  placeholder ``"tarfa.lm_eval:TarfaLM"`` (nothing of tarfa is imported until lm-eval asks for
  the model), then imports ``lm_eval.models``, lm-eval's own table of placeholders, because
  ``get_model`` imports it only while the registry is empty;
- older lm-eval (a plain ``MODEL_REGISTRY`` dict): imports ``tarfa.lm_eval``, which registers the
  class with ``register_model``.

Nothing here ever raises: a failure leaves lm-eval as it would be without tarfa. Without lm-eval
the finder is never asked about the name. ``TARFA_LM_EVAL_HOOK=0`` turns it off.
"""

import os
import sys

_REGISTRY = "lm_eval.api.registry"
_MODEL = "tarfa"
_TARGET = "tarfa.lm_eval:TarfaLM"


def _register(module):
    """Registers the model in the just-imported `lm_eval.api.registry` module."""
    try:
        registry = getattr(module, "model_registry", None)
        if registry is not None and hasattr(registry, "register"):
            if _MODEL not in registry:
                registry.register(_MODEL, target=_TARGET)
            import lm_eval.models  # noqa: F401  (lm-eval's own models, as get_model would)
        elif isinstance(getattr(module, "MODEL_REGISTRY", None), dict):
            import tarfa.lm_eval  # noqa: F401  (registers itself)
    except Exception:
        pass


class _Finder:
    """A `sys.meta_path` finder for `lm_eval.api.registry` alone (see the module's docstring)."""

    _busy = False

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != _REGISTRY or cls._busy:
            return None
        cls._busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is cls or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            loader = getattr(spec, "loader", None)
            exec_module = getattr(loader, "exec_module", None)
            if exec_module is None:
                return spec

            def exec_and_register(module):
                exec_module(module)
                _register(module)

            # the loader object is this module's own (a FileFinder makes one per spec)
            loader.exec_module = exec_and_register
            return spec
        except Exception:
            return None
        finally:
            cls._busy = False
            try:
                sys.meta_path.remove(cls)  # one module, once
            except ValueError:
                pass


def install():
    """Puts the finder first in `sys.meta_path` (once); a no-op if lm-eval's registry is loaded."""
    if os.environ.get("TARFA_LM_EVAL_HOOK", "1") == "0":
        return
    if _REGISTRY in sys.modules:
        _register(sys.modules[_REGISTRY])
    elif _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


try:
    install()
except Exception:
    pass
