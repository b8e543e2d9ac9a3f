"""Every module imports by its dotted path: no public name of a package hides a submodule
of the same name (`import tokpipe_compiler.X.Y as m` then gives the function, or fails)."""

import importlib
import pkgutil

import pytest

import tokpipe_compiler

PACKAGES = ["tokpipe_compiler"] + [
    info.name for info in pkgutil.walk_packages(tokpipe_compiler.__path__, "tokpipe_compiler.")
    if info.ispkg]


def _submodules(package: str) -> list[str]:
    path = importlib.import_module(package).__path__
    return [f"{package}.{info.name}" for info in pkgutil.iter_modules(path)]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_attribute_of_a_package_hides_its_submodule(package):
    module = importlib.import_module(package)
    hidden = []
    for name in _submodules(package):
        importlib.import_module(name)
        attribute = getattr(module, name.rsplit(".", 1)[1])
        if attribute is not importlib.import_module(name):
            hidden.append(name)
    assert not hidden, f"{hidden} are hidden by attributes of {package} of the same name"


def test_a_module_path_imports_as_itself():
    import tokpipe_compiler.dynamo_backend as backend_module
    import tokpipe_compiler.pipelines.parallel_pipeline as pipeline_module
    import tokpipe_compiler.stage_programs.pipelined as pipelined_module

    assert pipelined_module.__name__ == "tokpipe_compiler.stage_programs.pipelined"
    assert backend_module.__name__ == "tokpipe_compiler.dynamo_backend"
    assert pipeline_module.parallelize is tokpipe_compiler.parallelize


def test_the_errors_the_readme_names_are_public():
    import tokpipe_compiler as tp
    from tokpipe_compiler.core.errors import PeerStopped

    assert tp.PeerStopped is PeerStopped and issubclass(tp.PeerStopped, tp.TokpipeError)
