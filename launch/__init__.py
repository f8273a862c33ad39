"""pdd.launch"""
