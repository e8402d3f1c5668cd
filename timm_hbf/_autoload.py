"""``import timm`` registers timm_hbf's models in every process, without ``import timm_hbf``.

Installs put this file at the root of site-packages only, as the module ``_timm_hbf_autoload`` (so that importing
it does not import the timm_hbf package), beside ``timm_hbf-autoload.pth``, whose line Python runs at start-up: it
calls :func:`install`. That only puts a finder at the front of ``sys.meta_path``: a process that never imports timm
pays one function call per import, and never imports torch or timm_hbf because of it. When timm is imported, the
finder returns timm's own spec with a loader that runs timm's ``__init__``, takes the finder off ``sys.meta_path`` and
imports ``timm_hbf``, which registers the models. Any error there becomes a warning: ``import timm`` keeps working,
without our models.

``TIMM_HBF_NO_AUTOLOAD=1`` turns it off for a process (``python -S`` and ``python -I`` skip every ``.pth`` anyway).
"""
import os
import sys

ENV_VAR = 'TIMM_HBF_NO_AUTOLOAD'


class TimmFinder:
    """Meta path finder that answers for ``timm`` only: timm's own spec, with :class:`RegisteringLoader`."""

    def __init__(self) -> None:
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != 'timm' or self._searching:
            return None
        self._searching = True  # the search below goes through sys.meta_path again
        try:
            from importlib.util import find_spec
            spec = find_spec('timm')
        except Exception:
            return None  # the finders after this one run next, as if this one did not exist
        finally:
            self._searching = False
        if spec is not None and hasattr(spec.loader, 'exec_module'):
            spec.loader = RegisteringLoader(spec.loader)
        return spec


class RegisteringLoader:
    """Wraps timm's loader: runs timm's ``__init__``, then imports timm_hbf."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # timm keeps its own loader (reload, resources)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TimmFinder)]  # done: timm loads once
        self.loader.exec_module(module)
        try:
            import timm_hbf  # noqa: F401  (registers the models)
        except Exception as e:
            import warnings
            with warnings.catch_warnings():  # shown, never raised (-W error): `import timm` must not fail here
                warnings.simplefilter('default', RuntimeWarning)
                warnings.warn(
                    f'timm_hbf could not register its models with timm ({type(e).__name__}: {e}). timm works without '
                    f'them; `import timm_hbf` shows the full error, and {ENV_VAR}=1 turns this hook off.',
                    RuntimeWarning,
                )


def install() -> None:
    """Put the finder on ``sys.meta_path``, unless ``TIMM_HBF_NO_AUTOLOAD`` is set, timm is already imported or the
    finder is there already (``site`` can process the same site-packages twice)."""
    if (os.environ.get(ENV_VAR, '') in ('', '0') and 'timm' not in sys.modules
            and not any(isinstance(f, TimmFinder) for f in sys.meta_path)):
        sys.meta_path.insert(0, TimmFinder())
