"""The ``json`` suite: JSON-schema extraction, as users run it through ``with_structured_output``.

Each task is a short text (made up, so the facts can only come from it), a JSON schema, and the values a
correct extraction holds. A reply scores where it parses, validates against the schema, and every expected
field matches (strings compared case- and space-insensitively, numbers as numbers).
"""

from __future__ import annotations

import json

_S, _N, _I = {"type": "string"}, {"type": "number"}, {"type": "integer"}


def _obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


EXTRACTIONS: list[tuple[str, str, dict, dict]] = [
    ("invoice", "Invoice 2024-117 from Norrvik Timber AB to Gull Bay Marina, dated 3 March 2024. Items: 40 cedar "
     "planks at 12.50 EUR each and 6 boxes of brass screws at 8.00 EUR each. Total due: 548.00 EUR within 30 days.",
     _obj(invoice_number=_S, seller=_S, buyer=_S, total=_N, currency=_S, payment_days=_I),
     {"invoice_number": "2024-117", "seller": "Norrvik Timber AB", "buyer": "Gull Bay Marina", "total": 548,
      "currency": "EUR", "payment_days": 30}),
    ("meeting", "Hi all, the design review for the Osprey billing service moves to Thursday 14 November at 15:30 in "
     "room Larch-2. Priya Raman will present; please read the draft RFC beforehand. — Tom",
     _obj(topic=_S, day=_S, time=_S, room=_S, presenter=_S),
     {"topic": "design review for the Osprey billing service", "day": "Thursday 14 November", "time": "15:30",
      "room": "Larch-2", "presenter": "Priya Raman"}),
    ("product", "The Fennwick K7 is a cordless kettle with a 1.7 litre steel body, 2200 W heating element and "
     "five temperature presets. It weighs 1.1 kg and sells for 64.90 GBP.",
     _obj(name=_S, capacity_litres=_N, power_watts=_I, presets=_I, weight_kg=_N, price=_N),
     {"name": "Fennwick K7", "capacity_litres": 1.7, "power_watts": 2200, "presets": 5, "weight_kg": 1.1,
      "price": 64.9}),
    ("contact", "You can reach our support lead, Mateo Ilunga, at mateo.ilunga@brightquay.io or on +44 20 7946 "
     "0321. He works from the Leeds office, Monday to Friday.",
     _obj(name=_S, email=_S, phone=_S, office=_S),
     {"name": "Mateo Ilunga", "email": "mateo.ilunga@brightquay.io", "phone": "+44 20 7946 0321",
      "office": "Leeds"}),
    ("job", "Harrow & Pike is hiring a senior data engineer in Rotterdam (hybrid, 3 days on site). Salary range "
     "72,000 to 88,000 EUR. Required: 5 years with Spark and Airflow. Apply by 20 January.",
     _obj(company=_S, role=_S, city=_S, salary_min=_I, salary_max=_I, years_required=_I),
     {"company": "Harrow & Pike", "role": "senior data engineer", "city": "Rotterdam", "salary_min": 72000,
      "salary_max": 88000, "years_required": 5}),
    ("order", "Order #88412 shipped on 9 May via Cobalt Freight, tracking CF-5512-0093. It contains 3 items and "
     "weighs 4.6 kg; delivery is expected on 13 May.",
     _obj(order_id=_S, carrier=_S, tracking=_S, items=_I, weight_kg=_N, expected_delivery=_S),
     {"order_id": "88412", "carrier": "Cobalt Freight", "tracking": "CF-5512-0093", "items": 3, "weight_kg": 4.6,
      "expected_delivery": "13 May"}),
    ("event", "The Saltmarsh Chamber Orchestra plays Dvořák's Serenade for Strings at St. Brannock's Hall on "
     "Saturday 22 February, doors at 19:00. Tickets cost 18 euros, students 9 euros.",
     _obj(performer=_S, work=_S, venue=_S, date=_S, ticket_price=_N, student_price=_N),
     {"performer": "Saltmarsh Chamber Orchestra", "work": "Serenade for Strings", "venue": "St. Brannock's Hall",
      "date": "Saturday 22 February", "ticket_price": 18, "student_price": 9}),
    ("bug", "Bug report: after upgrading Lumen CLI from 3.4.1 to 3.5.0, `lumen sync` crashes with a "
     "KeyError: 'region' on Ubuntu 22.04. Severity: high. Reported by j.okoro.",
     _obj(tool=_S, old_version=_S, new_version=_S, command=_S, error=_S, os=_S, severity=_S),
     {"tool": "Lumen CLI", "old_version": "3.4.1", "new_version": "3.5.0", "command": "lumen sync",
      "error": "KeyError: 'region'", "os": "Ubuntu 22.04", "severity": "high"}),
]


def _same(got, want) -> bool:
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        try:
            return abs(float(got) - float(want)) < 1e-6
        except (TypeError, ValueError):
            return False
    norm = lambda v: " ".join(str(v).lower().replace("#", "").split())  # noqa: E731
    return norm(got) == norm(want) or norm(want) in norm(got)


def score_extraction(reply: str, schema: dict, expected: dict) -> bool:
    import jsonschema

    try:
        value = json.loads(reply)
        jsonschema.validate(value, schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return all(_same(value.get(key), want) for key, want in expected.items())
