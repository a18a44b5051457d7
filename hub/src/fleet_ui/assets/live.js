// Keeps the page live: the hub sends an event on /events when its view changed (at most
// a few a second); the page is then fetched again and its <main> replaced, without a
// reload. Without JavaScript the page is complete as served.
(function () {
  "use strict";
  if (!window.EventSource || !window.fetch || !window.DOMParser) return;
  var fetching = false;
  var again = false;

  function typing() {
    var active = document.activeElement;
    return active && active.closest && active.closest("main form") !== null;
  }

  function refresh() {
    // A form being filled in is not replaced under the user's hands.
    if (fetching || typing()) { again = true; return; }
    fetching = true;
    again = false;
    fetch(window.location.href, { headers: { "Accept": "text/html" }, cache: "no-store" })
      .then(function (response) { return response.ok ? response.text() : null; })
      .then(function (html) {
        if (html === null) return;
        var next = new DOMParser().parseFromString(html, "text/html");
        var main = next.querySelector("main");
        if (main) {
          document.querySelector("main").replaceWith(main);
          document.title = next.title;
        }
      })
      .catch(function () {})
      .then(function () {
        fetching = false;
        if (again) window.setTimeout(refresh, 250);
      });
  }

  document.addEventListener("focusout", function () { if (again) window.setTimeout(refresh, 0); });
  new EventSource("/events").addEventListener("changed", refresh);
})();
