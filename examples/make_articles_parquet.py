"""Write examples/articles.parquet: a small table of documents for the Parquet and template examples.

    python examples/make_articles_parquet.py

Columns: doc_id (the id), title, text, and a per-row max_tokens. Jobs read it with
``id_field: doc_id`` and a ``prompt_template`` over ``$title`` and ``$text``.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ARTICLES = [
    ("a-001", "Tides", "Tides are the rise and fall of sea levels caused by the gravity of the Moon and the Sun "
     "acting on the rotating Earth. Most coasts see two high and two low tides a day."),
    ("a-002", "Bread", "Bread rises because yeast ferments sugars in the dough and releases carbon dioxide, which "
     "the gluten network traps as bubbles. Baking sets the structure."),
    ("a-003", "Compilers", "A compiler translates source code into machine code in stages: parsing into a syntax "
     "tree, checking types, optimising an intermediate form, and emitting instructions."),
    ("a-004", "Bees", "Honey bees communicate the direction and distance of food with a waggle dance; the angle of "
     "the dance relative to vertical encodes the direction relative to the Sun."),
]


def main() -> Path:
    table = pa.table(
        {
            "doc_id": [a[0] for a in ARTICLES],
            "title": [a[1] for a in ARTICLES],
            "text": [a[2] for a in ARTICLES],
            "max_tokens": pa.array([96, 96, 128, 96], pa.int64()),
        }
    )
    path = Path(__file__).with_name("articles.parquet")
    pq.write_table(table, path)
    return path


if __name__ == "__main__":
    print(main())
