"""Writes qa.jsonl beside this file: questions and answers about countries, their capitals and continents; and
qa-heldout.jsonl: the same facts asked in other words, held out to measure what training taught."""

import json
from pathlib import Path

COUNTRIES = [
    ("France", "Paris", "Europe"),
    ("Germany", "Berlin", "Europe"),
    ("Italy", "Rome", "Europe"),
    ("Spain", "Madrid", "Europe"),
    ("Portugal", "Lisbon", "Europe"),
    ("Netherlands", "Amsterdam", "Europe"),
    ("Belgium", "Brussels", "Europe"),
    ("Austria", "Vienna", "Europe"),
    ("Switzerland", "Bern", "Europe"),
    ("Poland", "Warsaw", "Europe"),
    ("Sweden", "Stockholm", "Europe"),
    ("Norway", "Oslo", "Europe"),
    ("Finland", "Helsinki", "Europe"),
    ("Denmark", "Copenhagen", "Europe"),
    ("Ireland", "Dublin", "Europe"),
    ("Greece", "Athens", "Europe"),
    ("Hungary", "Budapest", "Europe"),
    ("Czechia", "Prague", "Europe"),
    ("Romania", "Bucharest", "Europe"),
    ("Bulgaria", "Sofia", "Europe"),
    ("Croatia", "Zagreb", "Europe"),
    ("Serbia", "Belgrade", "Europe"),
    ("Ukraine", "Kyiv", "Europe"),
    ("Iceland", "Reykjavik", "Europe"),
    ("Estonia", "Tallinn", "Europe"),
    ("Latvia", "Riga", "Europe"),
    ("Lithuania", "Vilnius", "Europe"),
    ("Japan", "Tokyo", "Asia"),
    ("China", "Beijing", "Asia"),
    ("India", "New Delhi", "Asia"),
    ("South Korea", "Seoul", "Asia"),
    ("Thailand", "Bangkok", "Asia"),
    ("Vietnam", "Hanoi", "Asia"),
    ("Indonesia", "Jakarta", "Asia"),
    ("Philippines", "Manila", "Asia"),
    ("Malaysia", "Kuala Lumpur", "Asia"),
    ("Pakistan", "Islamabad", "Asia"),
    ("Bangladesh", "Dhaka", "Asia"),
    ("Nepal", "Kathmandu", "Asia"),
    ("Iran", "Tehran", "Asia"),
    ("Iraq", "Baghdad", "Asia"),
    ("Saudi Arabia", "Riyadh", "Asia"),
    ("Turkey", "Ankara", "Asia"),
    ("Israel", "Jerusalem", "Asia"),
    ("Jordan", "Amman", "Asia"),
    ("Mongolia", "Ulaanbaatar", "Asia"),
    ("Kazakhstan", "Astana", "Asia"),
    ("Afghanistan", "Kabul", "Asia"),
    ("Egypt", "Cairo", "Africa"),
    ("Kenya", "Nairobi", "Africa"),
    ("Nigeria", "Abuja", "Africa"),
    ("Ethiopia", "Addis Ababa", "Africa"),
    ("Ghana", "Accra", "Africa"),
    ("Morocco", "Rabat", "Africa"),
    ("Algeria", "Algiers", "Africa"),
    ("Tunisia", "Tunis", "Africa"),
    ("Senegal", "Dakar", "Africa"),
    ("Uganda", "Kampala", "Africa"),
    ("Tanzania", "Dodoma", "Africa"),
    ("Rwanda", "Kigali", "Africa"),
    ("Zimbabwe", "Harare", "Africa"),
    ("Zambia", "Lusaka", "Africa"),
    ("Angola", "Luanda", "Africa"),
    ("Mali", "Bamako", "Africa"),
    ("Sudan", "Khartoum", "Africa"),
    ("Libya", "Tripoli", "Africa"),
    ("Canada", "Ottawa", "North America"),
    ("United States", "Washington", "North America"),
    ("Mexico", "Mexico City", "North America"),
    ("Cuba", "Havana", "North America"),
    ("Jamaica", "Kingston", "North America"),
    ("Panama", "Panama City", "North America"),
    ("Costa Rica", "San Jose", "North America"),
    ("Guatemala", "Guatemala City", "North America"),
    ("Brazil", "Brasilia", "South America"),
    ("Argentina", "Buenos Aires", "South America"),
    ("Chile", "Santiago", "South America"),
    ("Peru", "Lima", "South America"),
    ("Colombia", "Bogota", "South America"),
    ("Venezuela", "Caracas", "South America"),
    ("Ecuador", "Quito", "South America"),
    ("Uruguay", "Montevideo", "South America"),
    ("Paraguay", "Asuncion", "South America"),
    ("Bolivia", "Sucre", "South America"),
    ("Australia", "Canberra", "Oceania"),
    ("New Zealand", "Wellington", "Oceania"),
    ("Fiji", "Suva", "Oceania"),
    ("Papua New Guinea", "Port Moresby", "Oceania"),
    ("Samoa", "Apia", "Oceania"),
]


def pairs():
    for country, capital, continent in COUNTRIES:
        yield {"q": f"What is the capital of {country}?", "a": f"The capital of {country} is {capital}."}
        yield {"q": f"{capital} is the capital of which country?", "a": f"{capital} is the capital of {country}."}
        yield {"q": f"On which continent is {country}?", "a": f"{country} is in {continent}."}


def paraphrases():
    """Each trained fact asked another way, with the answer training teaches: what the eval loss measures."""
    for country, capital, continent in COUNTRIES:
        yield {"q": f"Which city is the capital of {country}?", "a": f"The capital of {country} is {capital}."}
        yield {"q": f"Which country has {capital} as its capital?", "a": f"{capital} is the capital of {country}."}
        yield {"q": f"Which continent is {country} in?", "a": f"{country} is in {continent}."}


if __name__ == "__main__":
    for name, rows in (("qa.jsonl", list(pairs())), ("qa-heldout.jsonl", list(paraphrases()))):
        out = Path(__file__).with_name(name)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{len(rows)} pairs in {out}")
