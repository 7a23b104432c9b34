"""Dataset machinery (:mod:`deqbench.data.base`) and the image datasets
(:mod:`deqbench.data.images`). :mod:`deqbench.run.data` registers the other built-in datasets and
re-exports these names; use ``deqbench.run.data.load_data``."""


def builtin_modules() -> list[str]:
    """The modules whose ``@dataset`` decorators add the built-in datasets (imported by the
    registry ``deqbench.core.registry.datasets`` on first use), found in the source by
    :mod:`deqbench.core.index`: a dataset in a new module is registered with no list to edit."""
    from ..core.index import modules

    return modules("datasets")
