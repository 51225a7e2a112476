"""kv_tiers"""
