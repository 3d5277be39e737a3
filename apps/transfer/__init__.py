"""The bank-transfer demo: bank A ("alipay") debits, bank B ("yuebao") credits, exactly once.

`python -m apps.transfer --help`; see apps/transfer/README.md.
"""
