"""Thin entry points, one per mode (``distill.__main__.MODES``): read the config, build the
parts from the libraries below (``train``, ``model``, ``pipeline``), run, clean up."""
