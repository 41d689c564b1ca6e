"""The `specbuild` Click CLI: thin commands over the library (parse, call one function, map errors)."""
