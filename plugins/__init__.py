"""Built-in backend and compressor plugins (installed as ``vcga.plugins``).

Each module is a plain pluggy plugin, loaded by module name through the same path as an
out-of-tree plugin, and imports only the public core API (:data:`vcga.contract.PUBLIC_API`) --
never another plugin (tests/test_walls.py).
"""
