"""The datasets: the machinery (:mod:`deqbench.data.base`: ``load_data``, ``DataBundle``, the
``@dataset`` decorator) and the built-in loaders: the small offline ones
(:mod:`deqbench.data.small`), the image sets (:mod:`deqbench.data.images`) and those of the kGLM
experiments (:mod:`deqbench.data.kglm`)."""


def builtin_modules() -> list[str]:
    """The modules whose ``@dataset`` decorators add the built-in datasets (imported by the
    registry ``deqbench.core.registry.datasets`` on first use), found in the source by
    :mod:`deqbench.core.index`: a dataset in a new module is registered with no list to edit."""
    from ..core.index import modules

    return modules("datasets")
