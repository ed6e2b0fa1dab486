"""Random but valid bookshop traffic, for tests and benchmarks that need a realistic log."""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

Post = Callable[[str, dict[str, Any]], tuple[int, Any]]


class Workload:
    """Keeps what it created so each command it sends is one the domain should accept."""

    def __init__(self, post: Post, seed: int = 7) -> None:
        self.post = post
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.customers: list[str] = []
        self.books: dict[str, int] = {}  # book_id -> price the generator last set
        self.orders: dict[str, tuple[int, str]] = {}  # order_id -> (total, status)
        self.statuses: Counter[int] = Counter()
        self.last_position: str | None = None

    def _send(self, name: str, body: dict[str, Any]) -> Any:
        status, answer = self.post(name, body)
        with self.lock:
            self.statuses[status] += 1
            if status == 201:
                self.last_position = answer["position"]
        return answer if status == 201 else None

    def seed(self, customers: int = 5, books: int = 5) -> None:
        for _ in range(customers):
            self.register()
        for _ in range(books):
            self.add_book()

    def register(self) -> None:
        n = uuid.uuid4().hex[:6]
        r = self._send(
            "register-customer", {"data": {"name": f"C {n}", "email": f"{n}@example.com"}}
        )
        if r:
            with self.lock:
                self.customers.append(r["aggregate_id"])

    def add_book(self) -> None:
        price = self.rng.randint(100, 5000)
        author = self.rng.choice(["Austen", "Herbert", "Le Guin", "Tolstoy", "Morrison"])
        data = {
            "title": f"T {uuid.uuid4().hex[:4]}",
            "author": author,
            "price_cents": price,
            "royalty_rate": self.rng.choice([0.0, 0.05, 0.1, 0.125, 0.3333, 0.5]),
        }
        r = self._send("add-book", {"data": data})
        if r:
            with self.lock:
                self.books[r["aggregate_id"]] = price

    def step(self) -> None:
        with self.lock:
            choice = self.rng.random()
            customers, books = list(self.customers), dict(self.books)
            orders = list(self.orders.items())
        if choice < 0.06 or not customers:
            self.register()
        elif choice < 0.11 or not books:
            self.add_book()
        elif choice < 0.15:
            book = self.rng.choice(list(books))
            price = self.rng.randint(100, 5000)
            if self._send("reprice-book", {"aggregate_id": book, "data": {"price_cents": price}}):
                with self.lock:
                    self.books[book] = price
        elif choice < 0.19:
            c = self.rng.choice(customers)
            self._send("rename-customer", {"aggregate_id": c, "data": {"name": f"R {choice:.4f}"}})
        elif choice < 0.21:
            c = self.rng.choice(customers)
            email = f"{uuid.uuid4().hex[:6]}@example.org"
            self._send("change-customer-email", {"aggregate_id": c, "data": {"email": email}})
        elif choice < 0.50 or not orders:
            lines = [
                {"book_id": b, "quantity": self.rng.randint(1, 5)}
                for b in self.rng.sample(list(books), k=min(len(books), self.rng.randint(1, 3)))
            ]
            total = sum(line["quantity"] * books[line["book_id"]] for line in lines)
            data = {"customer_id": self.rng.choice(customers), "lines": lines}
            r = self._send("place-order", {"data": data})
            if r:
                with self.lock:
                    self.orders[r["aggregate_id"]] = (total, "placed")
        else:
            order, (total, status) = self.rng.choice(orders)
            if status == "placed" and choice < 0.85:
                if self._send(
                    "pay-order", {"aggregate_id": order, "data": {"amount_cents": total}}
                ):
                    self._set(order, total, "paid")
            elif status == "paid" and choice < 0.95:
                if self._send("ship-order", {"aggregate_id": order, "data": {}}):
                    self._set(order, total, "shipped")
            elif status in ("placed", "paid"):
                cancel = {"aggregate_id": order, "data": {"reason": "test"}}
                if self._send("cancel-order", cancel):
                    self._set(order, total, "cancelled")

    def _set(self, order: str, total: int, status: str) -> None:
        with self.lock:
            self.orders[order] = (total, status)
