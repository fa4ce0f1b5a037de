MODEL_MAPPING = {"dummy": "lm_eval.models.dummy:DummyLM"}


def _register_all_models():
    from lm_eval.api.registry import model_registry

    for name, path in MODEL_MAPPING.items():
        if name not in model_registry:
            model_registry.register(name, target=path)


_register_all_models()
