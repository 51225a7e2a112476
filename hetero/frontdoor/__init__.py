"""frontdoor"""
