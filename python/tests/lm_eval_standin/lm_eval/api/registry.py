"""lm-eval 0.4.13's model registry, reduced to what the hook and get_model use."""

import importlib

from lm_eval.api.model import LM


class Registry:
    def __init__(self, name):
        self._name = name
        self._objs = {}

    def register(self, *aliases, target=None):
        def store(alias, obj):
            current = self._objs.get(alias)
            if current is not None and current != obj:
                if isinstance(current, str) and isinstance(obj, type) and current == f"{obj.__module__}:{obj.__name__}":
                    self._objs[alias] = obj
                    return
                raise ValueError(f"{self._name!r} alias '{alias}' already registered")
            self._objs[alias] = obj

        if target is not None:
            if len(aliases) != 1:
                raise ValueError("Exactly one alias required when using 'target='")
            store(aliases[0], target)
            return lambda x: x

        def decorator(obj):
            for a in aliases:
                store(a, obj)
            return obj

        return decorator

    def get(self, alias):
        target = self._objs[alias]
        if isinstance(target, str):
            mod, _, attr = target.partition(":")
            target = getattr(importlib.import_module(mod), attr)
            self._objs[alias] = target
        return target

    def __contains__(self, alias):
        return alias in self._objs

    def __len__(self):
        return len(self._objs)

    def keys(self):
        return self._objs.keys()

    def raw(self, alias):
        return self._objs.get(alias)


model_registry = Registry("model")


def register_model(*names):
    def decorate(cls):
        assert issubclass(cls, LM)
        model_registry.register(*names)(cls)
        return cls

    return decorate


def get_model(model_name):
    if len(model_registry) == 0:
        import lm_eval.models  # noqa: F401
    try:
        return model_registry.get(model_name)
    except KeyError:
        raise ValueError(f"Attempted to load model '{model_name}', but no model for this name found!") from None
