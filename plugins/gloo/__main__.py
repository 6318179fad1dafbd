"""``python -m vcga.plugins.gloo --measure``: measure gloo's capability table and write it."""

if __name__ == "__main__":
    import sys

    from .measure import TABLE_FILE, write_table

    if sys.argv[1:] == ["--measure"]:
        write_table()
        print(f"wrote {TABLE_FILE}")
    else:
        print("usage: python -m vcga.plugins.gloo --measure")
        sys.exit(2)
