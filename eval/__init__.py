"""pdd.eval"""
