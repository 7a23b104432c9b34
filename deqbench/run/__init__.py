"""The run machinery: suite schema (``suite``, ``specs``, ``matrix``, ``yamlio``), tasks and the
runner (``task``, ``runner``, ``executors``), data and training (``data``, ``train``), results,
console, environment, plots, plugin checks and the plugin scaffold.
"""
