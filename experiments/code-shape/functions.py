#!/usr/bin/env python3
"""Functions of the library crates and the binary by length (from the `fn` line to its closing
brace; test modules left out), longest first: every function over 100 lines, then the counts
over 120 and over 100.

    python3 experiments/code-shape/functions.py [DIR ...]   # default: src and every crate's src
"""
import os
import re
import sys

pat=re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"C"\s+)?fn\s+(\w+)')
res=[]
roots=sys.argv[1:] or ['src','stages/src','kernels/src','scheduler/src','transport/src','experiments/src']
for root in roots:
  for dp,dn,fn in os.walk(root):
    for f in fn:
      if not f.endswith('.rs'): continue
      p=os.path.join(dp,f); L=open(p).read().split('\n')
      intest=False
      i=0
      while i<len(L):
        l=L[i]
        if re.match(r'^\s*#\[cfg\(test\)\]',l): 
          # skip rest of file's test module
          break
        m=pat.match(l)
        if m:
          depth=0;started=False;j=i
          while j<len(L):
            s=re.sub(r'"(\\.|[^"\\])*"','""',L[j]); s=re.sub(r"'(\\.|[^'\\])'","''",s); s=s.split('//')[0]
            for c in s:
              if c=='{': depth+=1;started=True
              elif c=='}': depth-=1
            if not started and s.rstrip().endswith(';'): break
            if started and depth<=0: break
            j+=1
          if started: res.append((j-i+1,p,m.group(7),i+1))
          i=j+1 if started else i+1
          continue
        i+=1
res.sort(reverse=True)
for n,p,name,line in res:
  if n>100: print(n,p,name,line)
print('over120',sum(1 for r in res if r[0]>120),'over100',sum(1 for r in res if r[0]>100))
