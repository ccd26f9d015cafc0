"""Hand-written GSM8K-style traces (written for these tests, not from any data set bench reports on)."""

TRACES = [
    ("A baker makes 12 rolls an hour for 5 hours. He sells 40 of them. How many rolls are left?",
     "He makes 12 * 5 = <<12*5=60>>60 rolls.\nHe has 60 - 40 = <<60-40=20>>20 rolls left.\n#### 20"),
    ("Mia reads 15 pages a day. Her book has 120 pages. How many days does she need?",
     "She needs 120 / 15 = <<120/15=8>>8 days.\n#### 8"),
    ("A box holds 6 eggs. Sam buys 7 boxes and breaks 5 eggs. How many whole eggs does he have?",
     "Sam buys 6 * 7 = <<6*7=42>>42 eggs.\nAfter breaking some he has 42 - 5 = <<42-5=37>>37 eggs.\n#### 37"),
    ("Tickets cost $9 each. A class of 23 students and 2 teachers goes to the show. What is the total cost?",
     "There are 23 + 2 = <<23+2=25>>25 people.\nThe tickets cost 25 * 9 = <<25*9=225>>225 dollars.\n#### 225"),
    ("Leo has 3 times as many marbles as Ana. Ana has 14. How many do they have together?",
     "Leo has 3 * 14 = <<3*14=42>>42 marbles.\nTogether they have 42 + 14 = <<42+14=56>>56 marbles.\n#### 56"),
    ("A train travels 80 km an hour for 3 hours, then 60 km an hour for 2 hours. How far does it go?",
     "First it goes 80 * 3 = <<80*3=240>>240 km.\nThen it goes 60 * 2 = <<60*2=120>>120 km.\n"
     "In total it goes 240 + 120 = <<240+120=360>>360 km.\n#### 360"),
    ("Nora saves $25 a week. How many weeks until she can buy a $300 bike?",
     "She needs 300 / 25 = <<300/25=12>>12 weeks.\n#### 12"),
    ("A garden has 9 rows of 11 tulips. A rabbit eats 17 tulips. How many tulips remain?",
     "The garden has 9 * 11 = <<9*11=99>>99 tulips.\nThere remain 99 - 17 = <<99-17=82>>82 tulips.\n#### 82"),
]


def write_traces(path, n=len(TRACES)):
    """The first n traces as GSM8K-format JSONL (question, answer)."""
    import json

    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in TRACES[:n]))
    return path
