"""The project around the package: its layering, its packaging, the docs and examples
that must run, the cost gate's logic and the shape of this test tree."""
