class LM:
    def __init__(self):
        pass

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        args = dict(kv.split("=", 1) for kv in arg_string.split(",") if kv)
        return cls(**args, **(additional_config or {}))
