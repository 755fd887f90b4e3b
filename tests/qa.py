"""A small set of real question/answer pairs for training tests."""

QA_PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the capital of Kenya?", "The capital of Kenya is Nairobi."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("How many legs does an insect have?", "An insect has six legs."),
    ("Which planet is known as the red planet?", "Mars is known as the red planet."),
    ("Which planet is the largest?", "Jupiter is the largest planet."),
    ("What colour is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What gas do plants take in?", "Plants take in carbon dioxide."),
    ("What is water made of?", "Water is made of hydrogen and oxygen."),
    ("What is the boiling point of water at sea level?", "Water boils at one hundred degrees Celsius at sea level."),
]


def pairs(n: int | None = None) -> list[dict]:
    rows = [{"q": q, "a": a} for q, a in QA_PAIRS]
    return rows[:n] if n else rows
