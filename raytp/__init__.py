"""raytp: tensor-parallel GPT and Llama training on Ray that survives failures and rescales.

    import raytp
    result = raytp.train("jobs/default.yaml", overrides={"train.steps": 100})

`raytp.train` is also the name of the package of the training step (raytp/train/: schedule, step,
optimizer), so that package is made callable: calling it is raytp.api.train, and
`from raytp.train.step import ...` is what it was. `import raytp` is cheap: torch and Ray load when
raytp.api is first used (a call of raytp.train, or one of the names below).
"""
import importlib
import types

from raytp import train as _train_package  # an empty __init__: importing it costs nothing

__all__ = ["BadJob", "Interrupted", "Result", "RunFailed", "TrainError", "train"]
_API = set(__all__) - {"train"}


class _CallableTrainPackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        """raytp.api.train(job, overrides=None, address=None, run_dir=None, resume=False, name=None, *,
        out=None) -> Result: run a job to its end in this process."""
        from raytp.api import train
        return train(*args, **kwargs)

    def __reduce__(self):  # by name, as a pickler takes any importable module (a Ray Tune trainable's global)
        return importlib.import_module, (self.__name__,)


_train_package.__class__ = _CallableTrainPackage


def __getattr__(name: str):
    if name in _API:
        from raytp import api
        return getattr(api, name)
    raise AttributeError(f"module 'raytp' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
