"""The e-commerce order demo: paying an order updates the order database and announces
`order.paid` in one transactional message; logistics, points and cart each apply it once.

Run it with `python -m apps.orders` (see README.md next to this file).
"""
